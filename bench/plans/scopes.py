"""What the global stitching scope changes in the zoo's plans: counted
memory-intensive bytes and kernels, modeled time under the latency-evaluator, per training
model and column_reduce_broadcast on V100/A100/H100, with the global scope off (the block
scopes alone, as before it existed) and on.

    python -m bench.plans.scopes measure off OUT_OFF.json     # ~3 min each on 2 busy cores
    python -m bench.plans.scopes measure on OUT_ON.json
    python -m bench.plans.scopes render OUT_OFF.json OUT_ON.json   # markdown to stdout
    python -m bench.plans.scopes kernels        # the global-scope kernels of the plans

"off" replaces ``feasibility.global_phases`` by a refusal, so neither the explorer nor the
tuner sees the global scope. XLA's fusions are scheduled by the same tuner (bench.plans.zoo), so
their modeled time changes too: a kernel XLA launches may get a global-scope schedule.
"""
from __future__ import annotations

import json
import sys
import time

MODELS = ("bert_layer_train", "transformer_train", "dien_train", "log_softmax_xent_train",
          "column_reduce_broadcast")
TARGETS = ("v100", "a100", "h100")


def measure(mode: str, out: str) -> None:
    import stitch.analysis.feasibility as feasibility
    if mode == "off":
        feasibility.global_phases = lambda graph, members: "global scope off"
    from bench.plans.zoo import plan_model
    rows = {}
    for model in MODELS:
        for target in TARGETS:
            start = time.perf_counter()
            r = plan_model(model, target)
            rows[f"{model}/{target}"] = dict(
                st_bytes=r.stitch.mem_bytes, st_us=r.stitch.latency_us,
                st_kernels=r.stitch.mem_kernels, xla_bytes=r.xla.mem_bytes,
                xla_us=r.xla.latency_us, bound=r.bytes_bound,
                plan_s=time.perf_counter() - start)
            print(model, target, f"{r.stitch.latency_us:.0f} us", flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


def render(off_path: str, on_path: str) -> str:
    off, on = json.load(open(off_path)), json.load(open(on_path))
    lines = ["| model | target | mem kernels off → on | mem MB off → on | bytes / bound "
             "off → on | stitch µs off → on | XLA µs off → on | stitch/XLA on |",
             "|---|---|---|---|---|---|---|---|"]
    for key in off:
        a, b = off[key], on[key]
        model, target = key.split("/")
        lines.append(
            f"| {model} | {target} | {a['st_kernels']} → {b['st_kernels']} | "
            f"{a['st_bytes'] / 1e6:.1f} → {b['st_bytes'] / 1e6:.1f} | "
            f"{a['st_bytes'] / a['bound']:.2f} → {b['st_bytes'] / b['bound']:.2f} | "
            f"{a['st_us']:.0f} → {b['st_us']:.0f} | {a['xla_us']:.0f} → {b['xla_us']:.0f} | "
            f"{b['st_us'] / b['xla_us']:.2f} |")
    return "\n".join(lines)


def kernels() -> str:
    """Per model x target: stitched kernels with a global-scope schedule, how many only the
    global scope can stitch (the block scopes refuse them), their modeled µs, and how many a
    chain of kernels (a launch per phase instead of a grid barrier) would model faster."""
    import stitch
    from stitch.analysis.feasibility import infeasible_reason
    from hlo_fixtures import DATA
    lines = ["| model | target | global kernels | block scopes refuse | their µs (sum) | "
             "barriers | chain faster |", "|---|---|---:|---:|---:|---:|---:|"]
    for model in MODELS:
        for target in TARGETS:
            plan = stitch.plan((DATA / model / f"full.gpu-{target}.hlo").read_text(),
                               target=target)
            found = refused = barriers = chain = 0
            seconds = 0.0
            for g in plan.graphs:
                for k in g.stitched.kernels:
                    if k.schedule is None or k.schedule.parts[0].kind != "global":
                        continue
                    scope = k.schedule.parts[0].scope
                    found += 1
                    refused += infeasible_reason(g.graph, k.members) is not None
                    barriers += scope.barriers
                    chain += scope.chain_us < k.schedule.modeled_us
                    seconds += k.modeled_us * g.stitched.weight
            lines.append(f"| {model} | {target} | {found} | {refused} | {seconds:.0f} | "
                         f"{barriers} | {chain} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv[:1] == ["measure"] and len(argv) == 3 and argv[1] in ("on", "off"):
        measure(argv[1], argv[2])
    elif argv[:1] == ["render"] and len(argv) == 3:
        print(render(argv[1], argv[2]))
    elif argv == ["kernels"]:
        print(kernels())
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
