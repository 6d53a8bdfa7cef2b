"""The kit's ``env`` step: what the check runs on. Writes ``<out>/env.json``.

Device facts from the CUDA driver (ctypes), jax's view of the device, versions of jax,
jaxlib and its CUDA plugins, the ptxas and libdevice stitch's discovery picks (and their
CUDA version), compute-sanitizer, and the target the pass plans for on this device.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "llvmlite", "numpy", "ml-dtypes", "numba-cuda", "cuda-bindings",
            "nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-nvcc-cu12", "flax", "optax",
            "equinox", "pulp", "highspy", "cupy")


def versions() -> dict[str, str | None]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def toolchain() -> dict:
    from stitch.codegen import toolchain as tc
    facts: dict = {}
    try:
        ptxas = tc.find_ptxas()
        facts["ptxas"] = str(ptxas)
        facts["ptxas_version"] = tc.ptxas_version(ptxas)
        facts["ptxas_sm_90"] = "sm_90" in tc.ptxas_arches(ptxas)
    except Exception as exc:  # noqa: BLE001 - recorded, the check goes on
        facts["ptxas_error"] = f"{type(exc).__name__}: {exc}"
    try:
        facts["libdevice"] = str(tc.find_libdevice())
    except Exception as exc:  # noqa: BLE001
        facts["libdevice_error"] = f"{type(exc).__name__}: {exc}"
    for tool in ("compute-sanitizer", "ncu", "nvdisasm", "nvidia-smi"):
        facts[tool] = shutil.which(tool)
    return facts


def device(rehearse: bool) -> dict:
    from bench.cuda_driver import CudaError, Driver
    if rehearse:
        return {"name": "none (rehearsal)"}
    try:
        facts = Driver().facts()
    except (OSError, CudaError) as exc:
        return {"name": "none", "error": f"{type(exc).__name__}: {exc}"}
    return asdict(facts)


def jax_view() -> dict:
    import jax
    view = {"backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()]}
    first = jax.devices()[0]
    view["compute_capability"] = getattr(first, "compute_capability", None)
    view["device_kind"] = getattr(first, "device_kind", None)
    return view


def nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    run = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                          "clocks.max.sm,clocks.max.mem", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20)
    return run.stdout.strip() or run.stderr.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_kit.env")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rehearse", action="store_true")
    args = parser.parse_args(argv)
    record: dict = {"python": sys.version.split()[0], "versions": versions(),
                    "device": device(args.rehearse), "toolchain": toolchain()}
    try:
        record["nvidia_smi"] = nvidia_smi()
    except (OSError, subprocess.TimeoutExpired) as exc:
        record["nvidia_smi"] = f"error: {exc}"
    try:
        record["jax"] = jax_view()
    except Exception as exc:  # noqa: BLE001
        record["jax"] = {"error": f"{type(exc).__name__}: {exc}"}
    from stitch.xla_pass.device_target import target_for_device_info
    cc = record["device"].get("compute_capability")
    record["target"] = target_for_device_info(record["device"].get("name", ""),
                                              tuple(cc) if cc else None)
    (args.out / "env.json").write_text(json.dumps(record, indent=1, default=str))
    for key in ("python", "device", "toolchain", "jax", "target"):
        print(f"{key}: {json.dumps(record[key], default=str)}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in record["versions"].items() if v))


if __name__ == "__main__":
    main()
