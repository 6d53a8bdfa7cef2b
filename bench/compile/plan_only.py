"""Planning alone, as the pass plans, on a module the pass dumped (deviceless).

    python -m bench.compile.plan_only MODULE.hlo [--json OUT] [--cached]

``MODULE.hlo``: a module the pass saw (``STITCH_DUMP_MODULES``; ``bench compile --part real``'s
children write them). Planned with XLA's instructions as units and the pass's chain and
grid-sync settings, no plan cache, under the pass's garbage-collector setting
(``xla_pass.collector.fewer_collections``: without it a 48-layer plan pays ~1.2 s of full
collections the pass does not). Prints wall and CPU seconds, the stitched plan's
summary and the planner's per-phase seconds;
``--json`` writes every planned kernel (kind, op names, cost) and each graph's
``plan_signature`` (launch order, members, costs, schedules, the objective, the
baseline) to compare two runs.
``--cached``: the warm compile's planning instead: planned once into a fresh temporary plan
cache, then planned again with a fresh memory cache on that directory (as a new process
would): prints the second ``plan`` call's wall seconds, the part rebuilding the plan from
its disk entry (``PlanCache.disk_seconds``), and whether that plan is the fresh one (every
kernel's members, kind, origin, cost, schedules, the objective and the launch order, the
baseline's too).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import pathlib
import tempfile
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", type=pathlib.Path)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--cached", action="store_true",
                        help="time the second, disk-cached planning (see the module doc)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
    logging.getLogger("stitch.explorer.planner").setLevel(logging.INFO)
    logging.getLogger("stitch.schedule").setLevel(logging.ERROR)

    from stitch.explorer.planner import ExplorerOptions, plan
    from stitch.hlo import parse_hlo
    from stitch.config import grid_sync_on_gpu
    from stitch.xla_pass.pass_planning import XLA_UNITS
    from stitch.xla_pass.segment_rows import segment_rows
    from stitch.xla_pass.collector import fewer_collections

    module = segment_rows(parse_hlo(args.module.read_text())).planned
    grid_sync = grid_sync_on_gpu()
    options = dataclasses.replace(
        ExplorerOptions(xla_units=XLA_UNITS),
        chain_tf32=True, chain_spill_check=True, chain_grid_sync=grid_sync != "off",
        grid_sync=grid_sync)
    if args.cached:
        with fewer_collections():
            _cached(module, options)
        return
    wall, cpu = time.perf_counter(), time.process_time()
    with fewer_collections():
        fusion_plan = plan(module, "h100", options=options, cache=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    summary = fusion_plan.summary()
    print(f"plan {wall:.2f} s wall, {cpu:.2f} s cpu")
    print("stitched", json.dumps(summary["stitched"]))
    for result in fusion_plan.graphs:
        detail = result.report.detail
        phases = {k: round(v, 2) for k, v in detail.items()
                  if k.endswith("_s") and isinstance(v, float)}
        print(result.graph.name, phases)
    if args.json is not None:
        kernels = sorted([k.kind, sorted(k.ops), k.cost.total_s]
                         for g in fusion_plan.graphs for k in g.stitched.kernels)
        # "The same plan" means all of ``plan_signature``: launch order, schedules, costs.
        args.json.write_text(json.dumps({"summary": summary, "kernels": kernels,
                                         "graphs": plan_signature(fusion_plan)},
                                        default=str))


def plan_signature(fusion_plan) -> list:
    """What makes two plans the same plan: per graph, its stitched and baseline kernels in
    launch order (name, kind, origin, members, cost, schedule, chain schedule, schedule
    note) and the stitched objective."""
    def kernels(graph_plan):
        return [[k.name, k.kind, k.origin, list(k.members), repr(k.cost), repr(k.schedule),
                 repr(k.chain_schedule), k.schedule_note] for k in graph_plan.kernels]
    return [[g.graph.name, g.stitched.objective_s, kernels(g.stitched), kernels(g.baseline)]
            for g in fusion_plan.graphs]


def _cached(module, options) -> None:
    from stitch.explorer.plan_cache import PlanCache
    from stitch.explorer.planner import plan

    with tempfile.TemporaryDirectory(prefix="plan-only-") as directory:
        wall = time.perf_counter()
        fresh = plan(module, "h100", options=options, cache=PlanCache(directory))
        print(f"fresh plan {time.perf_counter() - wall:.2f} s wall (written to the cache)")
        want = plan_signature(fresh)
        # As a new process: the fresh plan gone (its objects would weigh on the garbage
        # collector), empty memory, the same disk.
        del fresh
        gc.collect()
        store = PlanCache(directory)
        wall, cpu = time.perf_counter(), time.process_time()
        again = plan(module, "h100", options=options, cache=store)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if store.disk_hits != 1:
        raise SystemExit(f"the second plan was no disk hit (misses {store.misses}, "
                         f"dropped {store.dropped})")
    print(f"cached plan {wall:.2f} s wall, {cpu:.2f} s cpu; rebuilt from disk in "
          f"{store.disk_seconds:.2f} s")
    got = plan_signature(again)
    if want == got:
        print("identical to the fresh plan: yes")
        return
    for w, g in zip(want, got):
        if w != g:
            first = next((i for i, (a, b) in enumerate(zip(w[2], g[2])) if a != b), None)
            print(f"identical to the fresh plan: NO (graph {w[0]}; first stitched kernel "
                  f"differing: {first})")
            raise SystemExit(1)
    raise SystemExit("identical to the fresh plan: NO (graph count)")


if __name__ == "__main__":
    main()
