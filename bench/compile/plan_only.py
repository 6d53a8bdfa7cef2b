"""Planning alone, as the pass plans, on a module the pass dumped (deviceless).

    python -m bench.compile.plan_only MODULE.hlo [--json OUT]

``MODULE.hlo``: a module the pass saw (``STITCH_DUMP_MODULES``; ``bench compile --part real``'s
children write them). Planned with XLA's instructions as units and the pass's chain and
grid-sync settings, no plan cache. Prints wall and CPU seconds, the stitched plan's
summary and the planner's per-phase seconds;
``--json`` writes every planned kernel (kind, op names, cost) to compare two runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", type=pathlib.Path)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
    logging.getLogger("stitch.explorer.planner").setLevel(logging.INFO)
    logging.getLogger("stitch.schedule").setLevel(logging.ERROR)

    from stitch.explorer.planner import ExplorerOptions, plan
    from stitch.hlo import parse_hlo
    from stitch.config import grid_sync_on_gpu
    from stitch.xla_pass.pass_planning import XLA_UNITS
    from stitch.xla_pass.segment_rows import segment_rows

    module = segment_rows(parse_hlo(args.module.read_text())).planned
    grid_sync = grid_sync_on_gpu()
    options = dataclasses.replace(
        ExplorerOptions(xla_units=XLA_UNITS),
        chain_tf32=True, chain_spill_check=True, chain_grid_sync=grid_sync != "off",
        grid_sync=grid_sync)
    wall, cpu = time.perf_counter(), time.process_time()
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
        # Launch order, schedules and objective per graph: "the same plan" means all of them.
        graphs = {g.graph.name: {"objective_s": g.stitched.objective_s,
                                 "launches": [[k.kind, k.origin, list(k.ops), k.cost.total_s,
                                               repr(k.schedule), repr(k.chain_schedule)]
                                              for k in g.stitched.kernels]}
                  for g in fusion_plan.graphs}
        args.json.write_text(json.dumps({"summary": summary, "kernels": kernels,
                                         "graphs": graphs}, default=str))


if __name__ == "__main__":
    main()
