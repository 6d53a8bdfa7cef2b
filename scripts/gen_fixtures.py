"""Regenerate the zoo's HLO fixtures under hlo_fixtures/data/<model>/.

For every zoo model and config (full, tiny) it writes:
  <config>.pre.hlo        jax pre-optimization HLO  (lower(...).as_text(dialect="hlo"))
  <config>.gpu-v100.hlo   XLA GPU optimized HLO by deviceless compilation for each target
  <config>.gpu-a100.hlo   (specs: ../shared/xla_gpu_specs/<target>.txtpb)
  <config>.gpu-h100.hlo
and hlo_fixtures/data/manifest.json (jax version, targets, files). The GPU stages need jax with the
CUDA plugin but no GPU, in a separate environment (several GB)::

    python -m venv /tmp/venv-cuda && /tmp/venv-cuda/bin/pip install "jax[cuda12]==0.10.2"
    PYTHONPATH=. /tmp/venv-cuda/bin/python scripts/gen_fixtures.py [--models a,b] [--specs DIR]

Tests only read the committed files; they never need this environment.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

# Deviceless XLA GPU compilation: no device is opened, the topology comes from the spec.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
DATA = REPO / "hlo_fixtures" / "data"
TARGETS = ("v100", "a100", "h100")


def gpu_shardings(spec_dir: pathlib.Path) -> dict[str, object]:
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    shardings = {}
    for target in TARGETS:
        config = (spec_dir / f"{target}.txtpb").read_text()
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=config)
        mesh = topologies.make_mesh(topo, (1,), ("d",))
        shardings[target] = NamedSharding(mesh, PartitionSpec())
    return shardings


def write(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def generate(model_names: list[str], spec_dir: pathlib.Path, with_gpu: bool) -> list[str]:
    from stitch.models import build, get_model

    shardings = gpu_shardings(spec_dir) if with_gpu else {}
    files: list[str] = []
    for name in model_names:
        for config in get_model(name).configs:
            inst = build(name, config)
            start = time.perf_counter()
            lowered = jax.jit(inst.fn).lower(*inst.arg_specs)
            stem = DATA / name / config
            write(stem.with_suffix(".pre.hlo"), lowered.as_text(dialect="hlo"))
            files.append(f"{name}/{config}.pre.hlo")
            for target, sharding in shardings.items():
                specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
                         for s in inst.arg_specs]
                text = jax.jit(inst.fn).lower(*specs).compile().as_text()
                write(stem.with_suffix(f".gpu-{target}.hlo"), text)
                files.append(f"{name}/{config}.gpu-{target}.hlo")
            print(f"{name}/{config}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", help="comma-separated model names (default: the whole zoo)")
    parser.add_argument("--specs", type=pathlib.Path,
                        default=REPO.parent / "shared" / "xla_gpu_specs",
                        help="folder with v100/a100/h100 .txtpb GPU target configs")
    parser.add_argument("--no-gpu", action="store_true", help="write only the pre stage")
    args = parser.parse_args()
    from stitch.models import list_models

    names = args.models.split(",") if args.models else list_models()
    files = generate(names, args.specs, with_gpu=not args.no_gpu)
    manifest_path = DATA / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest.update({
        "generator": "scripts/gen_fixtures.py",
        "jax": jax.__version__,
        "jaxlib": __import__("jaxlib").__version__,
        "gpu_targets": list(TARGETS) if not args.no_gpu else manifest.get("gpu_targets", []),
        "gpu_method": "deviceless XLA GPU compilation (jax.experimental.topologies)",
    })
    manifest["files"] = sorted(set(manifest.get("files", [])) | set(files))
    write(manifest_path, json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
