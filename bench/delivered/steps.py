"""Planned vs delivered on the project's third-party training steps (counted and modeled).

``python -m bench.delivered.steps [--steps NAME,...] [--out docs/benchmarks.md]``

Each step (``bench/thirdparty_steps.py``) is compiled for an H100 without a device (jax's
CUDA plugin in the venv scripts/deviceless_check.sh makes, ``STITCH_CUDA_VENV``, default
.venv-cuda), with stitch's pass on, in a fresh child process with an empty compile cache.
The pass prices XLA's module, its own plan and the module it returns with the delta cost
model (``stitch/xla_pass/delivered.py``): memory-intensive µs and bytes per step, the share of
the planned saving that reached the module, and the dropped kernels by kind. Settings are
the defaults unless the environment sets them (``STITCH_GRID_SYNC``...).
"""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from bench.report import REPO

SECTION = "bench-delivered"
REPO = REPO
MARK = "DELIVERED "


def measure_one(name: str) -> dict:
    """In the deviceless venv: compile step ``name`` with the pass, its delivery figures."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from bench.thirdparty_steps import build
    from stitch.xla_pass import deviceless

    deviceless.check_environment()
    fn, args, devices = build(name)
    shape = {1: "1x1x1", 2: "1x2x1", 4: "1x4x1"}[devices]
    mesh = topologies.make_mesh(deviceless.topology("h100", shape), (devices,), ("d",))
    replicated = NamedSharding(mesh, PartitionSpec())
    batch = NamedSharding(mesh, PartitionSpec("d"))

    def spec(i: int, a):
        sharding = batch if devices > 1 and i > 0 and getattr(a, "ndim", 0) >= 1 \
            else replicated
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), a)
    specs = [spec(i, a) for i, a in enumerate(args)]
    lowered = jax.jit(fn).lower(*specs)
    report = deviceless.compile_with_pass(lowered, name, "h100").report
    d = report.delivery
    return {"step": name, **report.summary(),
            "dropped": [[k.name, k.kind, round(k.planned_saving_us, 3), k.reason[:160]]
                        for k in d.dropped]}


def collect(names: list[str], timeout: float = 1800.0) -> list[dict]:
    from bench.delivered.children import run_one
    from bench.thirdparty_steps import XLA_FLAGS, available
    rows = []
    for name in names:
        why = available(name)
        if why is not None:
            rows.append({"step": name, "error": why})
            continue
        rows.append(run_one("bench.delivered.steps", name, MARK, "step", timeout,
                            XLA_FLAGS.get(name)))
    return rows


def markdown(rows: list[dict], command: str) -> str:
    from bench.report import stamp
    from bench.thirdparty_steps import XLA_FLAGS
    ok = [r for r in rows if "error" not in r]
    xla = sum(r["xla_mem_us"] for r in ok)
    planned = sum(r["planned_mem_us"] for r in ok)
    delivered = sum(r["delivered_mem_us"] for r in ok)
    lines = ["## Planned vs delivered: third-party training steps (counted and modeled)", "",
             stamp(command, os.getloadavg()), "",
             "Each step compiled for an H100 without a device, stitch's pass on "
             f"(STITCH_GRID_SYNC={os.environ.get('STITCH_GRID_SYNC', 'default')}). The pass "
             "prices XLA's module, its plan and the module it returns with the delta cost "
             "model (stitch/xla_pass/delivered.py): memory-intensive kernels, µs and KB per step "
             "(loop bodies times their trip counts). *share*: of the planned saving, what "
             "reached the module. *lost to*: planned saving of the kernels dropped, by kind "
             "(payback: left to XLA by design, its build would not repay; build: lowering or "
             "PTX refused; placement: snapping or the rewrite refused). *copies*: those the "
             "rewrite added in loop bodies, priced in *delivered*."
             + "".join(f" {step}: compiled with XLA_FLAGS={flags} (bench/thirdparty_steps.py "
                       "says why)." for step, flags in XLA_FLAGS.items()
                       if any(r["step"] == step for r in rows)), "",
             "*share w/o payback*: the same with the kernels left to XLA for payback taken "
             "out of the planned saving. The keras_hub steps need keras_hub both in the "
             "interpreter running the bench and in $STITCH_CUDA_VENV (scripts/"
             "deviceless_check.sh with PYTHON= an interpreter that has it).", "",
             "| step | XLA µs | planned µs | delivered µs | share | share w/o payback | "
             "XLA KB | planned KB | delivered KB | lost to payback / build / placement µs | "
             "copies |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['step']} | {r['error']} ||||||||||")
            continue
        share = "–" if r["delivered_share"] is None else f"{r['delivered_share']:.0%}"
        bare = _share(r["xla_mem_us"], r["planned_mem_us"] + r["dropped_payback_us"],
                      r["delivered_mem_us"])
        lines.append(
            f"| {r['step']} | {r['xla_mem_us']:.1f} | {r['planned_mem_us']:.1f} | "
            f"{r['delivered_mem_us']:.1f} | {share} | "
            f"{'–' if bare is None else f'{bare:.0%}'} | {r['xla_mem_bytes'] / 1e3:.1f} | "
            f"{r['planned_mem_bytes'] / 1e3:.1f} | {r['delivered_mem_bytes'] / 1e3:.1f} | "
            f"{r['dropped_payback_us']:.1f} / {r['dropped_build_us']:.1f} / "
            f"{r['dropped_placement_us']:.1f} | {r['copies']} |")
    if ok:
        share = _share(xla, planned, delivered)
        payback = sum(r["dropped_payback_us"] for r in ok)
        bare = _share(xla, planned + payback, delivered)
        worse = [r["step"] for r in ok if r["delivered_mem_us"] > r["xla_mem_us"] + 1e-6
                 or r["delivered_mem_bytes"] > r["xla_mem_bytes"]]
        lines += ["", f"Over the {len(ok)} steps: XLA {xla:.1f} µs, planned {planned:.1f} µs "
                  f"({xla / planned:.2f}× faster), delivered {delivered:.1f} µs "
                  f"({xla / delivered:.2f}× faster)"
                  + ("" if share is None else f"; {share:.0%} of the planned saving "
                     "delivered") + ("" if bare is None else
                                     f", {bare:.0%} with the {payback:.1f} µs left to XLA "
                                     "for payback excepted") + ". Final modules worse "
                  "than XLA's in memory-intensive µs or bytes: "
                  + (", ".join(worse) if worse else "none") + "."]
        reasons: dict[str, float] = {}
        for r in ok:
            for _name, kind, saving, reason in r["dropped"]:
                key = f"{kind}: {_reason_class(kind, reason)}"
                reasons[key] = reasons.get(key, 0.0) + saving
        if reasons:
            lines += ["", "Planned saving lost, by reason (µs, all steps):", ""]
            lines += [f"- {v:.1f} µs — {k}" for k, v in
                      sorted(reasons.items(), key=lambda kv: -kv[1])[:10]]
    return "\n".join(lines)


def _reason_class(kind: str, reason: str) -> str:
    """A drop reason without its kernel's own names and figures, to sum drops by."""
    if kind == "payback":
        return "its build would not repay within STITCH_PAYBACK_STEPS (left to XLA)"
    parts = reason.split(": ")
    # "CodegenError: <op name>: what" -> "CodegenError: what"
    text = f"{parts[0]}: {parts[2]}" if len(parts) >= 3 and " " not in parts[1] else reason
    return re.sub(r"\(\(?[a-z0-9]+\[[^)]*\)\)?", "(...)", text)[:100]


def _share(xla: float, planned: float, delivered: float) -> float | None:
    """Of the saving ``planned`` models against ``xla``, the share ``delivered`` kept."""
    return (xla - delivered) / (xla - planned) if xla - planned > 1e-9 else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.delivered.steps",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--steps", help="comma-separated step names (bench.thirdparty_steps)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(MARK + json.dumps(measure_one(args.one)), flush=True)
        return
    from bench.thirdparty_steps import STEPS
    names = args.steps.split(",") if args.steps else list(STEPS)
    rows = collect(names)
    command = "python -m bench.delivered.steps" + (f" --steps {args.steps}" if args.steps else "")
    text = markdown(rows, command)
    if args.out:
        from bench.report import write_section
        write_section(args.out, SECTION, text, after="bench-xla-units")
    else:
        print(text)


if __name__ == "__main__":
    main()
