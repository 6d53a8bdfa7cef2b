"""The kit's ``timings`` step: whole steps under ``stitch.jit`` against ``jax.jit``, and the
stitched kernels saved for the kernel steps.

Per model: both functions warmed up (``WARMUP`` calls), then ``REPEATS`` calls of each,
alternating, each to completion; medians. The stitched kernels the pass placed are written
as cubins (PTX where no ptxas fits the device) with ``bench.opt_levels``' manifest format
under ``<out>/kernels/`` (one variant, the default pipeline), each with the
latency-evaluator's modeled µs and the HBM bytes its parameters span, so ``bench.opt_levels
time`` times them on the device and compute-sanitizer checks them. Writes
``<out>/timings.json``.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from .step_cli import chosen_models, step_arguments

GPU_MODELS = (("layer_norm", "full"), ("log_softmax_xent_train", "full"),
              ("bert_layer_train", "tiny"), ("transformer_train", "tiny"),
              ("transformer_train_bf16", "tiny"), ("bert_layer_infer", "full"),
              # Segmented reductions: XLA's atomic scatters against one stitched kernel
              # (the contention term of stitch.cost.contention is an assumption until
              # these are timed), and the MoE combine in column tiles without atomics
              # (its chain of round trips, cost.contention.tiles_price, is modeled).
              ("segment_softmax_grad", "full"), ("embedding_bag", "full"),
              ("moe_layer", "full"))
REHEARSAL_MODELS = (("layer_norm", "tiny"), ("log_softmax_xent_train", "tiny"))
WARMUP = 3
REPEATS = 20
REHEARSAL_REPEATS = 5


def _median_s(fn, args, repeats: int) -> list[float]:
    import jax
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def save_kernels(report, model: str, config: str, arch: str, directory: Path,
                 manifest: dict) -> None:
    """Each placed kernel's image and launch facts into ``directory`` / ``manifest``."""
    from stitch.codegen import kir
    from stitch.codegen.llvm_emit import STORAGE_BYTES
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.pipelines import PIPELINES
    from stitch.codegen.toolchain import assemble_cubin

    variant = next(iter(PIPELINES))
    modeled = {k.name: k.modeled_us for k in report.plan.kernels} if report.plan else {}
    for built in report.kernels:
        kernel = built.lowered.kernel
        entry = {"model": model, "config": config, "entry": kernel.name,
                 "grid": kernel.grid, "block": kernel.block, "launches": kir.launches(kernel),
                 "cooperative": kir.has_grid_barrier(kernel) and kernel.grid_sync == "barrier",
                 "params": [{"name": p.name, "dtype": p.dtype, "size": p.size,
                             "bytes": STORAGE_BYTES[p.dtype], "output": p.is_output}
                            for p in kernel.params],
                 "modeled_us": modeled.get(built.name), "variants": {}}
        try:
            ptx = emit_ptx(kernel, arch)
            try:
                image, _ = assemble_cubin(ptx, arch, kernel_name=kernel.name)
                suffix = "cubin"
            except Exception as exc:  # noqa: BLE001 - the driver JIT-compiles the PTX
                print(f"timings: {kernel.name}: no cubin ({exc}); saving PTX", flush=True)
                image, suffix = ptx.encode(), "ptx"
        except Exception as exc:  # noqa: BLE001 - recorded per kernel
            manifest["errors"].append({"model": model, "config": config,
                                       "error": f"{kernel.name}: {type(exc).__name__}: {exc}"})
            continue
        name = f"{model}-{config}-{len(manifest['kernels'])}-{variant}.{suffix}"
        (directory / name).write_bytes(image)
        entry["variants"][variant] = {"cubin": name, "emit_s": 0.0, "ptxas_s": 0.0,
                                      "ptx_lines": ptx.count("\n"), "registers": 0,
                                      "spill_bytes": 0, "code_sha256": None}
        manifest["kernels"].append(entry)


def run_model(model: str, config: str, repeats: int, device: str, arch: str | None,
              kernels_dir: Path | None, manifest: dict) -> dict:
    import jax

    import stitch
    from stitch.models import build

    inst = build(model, config)
    args = [jax.numpy.asarray(a) for a in inst.random_args(3)]
    start = time.perf_counter()
    stitched = stitch.jit(inst.fn, async_compile=False, guard=False, device=device)
    jax.block_until_ready(stitched(*args))
    compile_s = time.perf_counter() - start
    stock = jax.jit(inst.fn)
    for _ in range(WARMUP):
        jax.block_until_ready(stock(*args))
        jax.block_until_ready(stitched(*args))
    stitched_times, stock_times = [], []
    for _ in range(repeats):        # alternating: both see the same machine state
        stock_times += _median_s(stock, args, 1)
        stitched_times += _median_s(stitched, args, 1)
    programs = stitched.programs()
    row = {"model": model, "config": config, "device": device,
           "stitch_compile_s": round(compile_s, 2),
           "stitched_calls": stitched.stats.stitched_calls,
           "stock_ms": round(1e3 * statistics.median(stock_times), 4),
           "stitched_ms": round(1e3 * statistics.median(stitched_times), 4)}
    row["speedup"] = round(row["stock_ms"] / row["stitched_ms"], 3) if row["stitched_ms"] else None
    if programs:
        report = programs[0]
        row["report"] = report.summary()
        if report.plan is not None:
            row["plan"] = report.plan.summary()
        if kernels_dir is not None and arch is not None:
            save_kernels(report, model, config, arch, kernels_dir, manifest)
    return row


def main(argv: list[str] | None = None) -> int:
    args = step_arguments("python -m bench.gpu_kit.timings", argv)
    import jax

    from stitch.codegen.pipelines import PIPELINES
    from stitch.xla_pass.entry import gpu_arch, target_arch

    device = "gpu" if jax.default_backend() == "gpu" else "cpu"
    arch = gpu_arch() if device == "gpu" else target_arch("h100")
    models = chosen_models(args, GPU_MODELS, REHEARSAL_MODELS)
    kernels_dir = args.out / "kernels"
    kernels_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"arch": arch, "variants": [{"name": n} for n in list(PIPELINES)[:1]],
                "kernels": [], "errors": []}
    rows = []
    for model, config in models:
        try:
            row = run_model(model, config, REHEARSAL_REPEATS if args.rehearse else REPEATS,
                            device, arch, kernels_dir, manifest)
        except Exception as exc:  # noqa: BLE001 - one model's failure is a row
            row = {"model": model, "config": config, "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        print(f"timings: {json.dumps({k: v for k, v in row.items() if k != 'plan'}, default=str)}",
              flush=True)
        # Written after every model: a timeout keeps what was measured.
        (kernels_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
        (args.out / "timings.json").write_text(json.dumps(
            {"device": device, "arch": arch, "models": rows}, indent=1, default=str))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
