"""Measure ``planner``: the planner's quality (beam against the BLP optimum, modeled) and
its cost (planning time against graph size, measured)."""
from __future__ import annotations

import argparse
import logging

from bench.measure import Context, Measure, Part

log = logging.getLogger("bench")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1000,2000,4000,8000,16000",
                        help="planner: synthetic graph sizes (ops) for the explorer scaling")
    parser.add_argument("--blp-time-limit", type=float, default=60.0)
    parser.add_argument("--scale-limit", type=float, default=60.0,
                        help="planner: seconds per module before it is cut off")
    parser.add_argument("--chains", default="1000,2000,4000,8000,16000,32000",
                        help="planner: chain / synthetic graph sizes (ops)")
    parser.add_argument("--corpus-dir", default=None,
                        help="planner: the extracted xla_hlo_corpus directory")


def run_blp(ctx: Context) -> list[str]:
    from bench.planner import search
    from bench.plans import zoo
    names = ctx.args.models or (["softmax"] if ctx.quick else zoo.models())
    rows = search.collect_blp(names, "h100", ctx.args.blp_time_limit, log.info)
    return search.blp_markdown(rows, "h100", ctx.args.blp_time_limit)[2:]


def run_scaling(ctx: Context) -> list[str]:
    from bench import plots
    from bench.planner import search
    sizes = [int(s) for s in ctx.args.sizes.split(",")]
    points = search.collect_scaling(sizes[:2] if ctx.quick else sizes, log.info)
    ctx.image("planner_scaling", lambda p: plots.planner_scaling(points, p))
    return search.scaling_markdown(points, ctx.image_link)[2:]


def run_scale(ctx: Context) -> list[str]:
    from pathlib import Path

    from bench.planner import scale
    chains = tuple(int(x) for x in ctx.args.chains.split(",") if x)
    corpus = Path(ctx.args.corpus_dir) if ctx.args.corpus_dir else scale.CORPUS
    rows = scale.collect(ctx.args.scale_limit, chains[:1] if ctx.quick else chains,
                         progress=log.info, corpus=corpus)
    return scale.markdown(rows, ctx.args.scale_limit)


MEASURE = Measure(
    name="planner",
    title="Planner: quality against the optimum (modeled) and planning time (measured)",
    summary="The beam planner's objective against a BLP solver's optimum and proven bound on "
            "the zoo (modeled µs), and planning time against graph size on synthetic graphs, "
            "the zoo and XLA's own test corpus (measured CPU seconds).",
    parts=(
        Part("blp", "Beam search against the BLP optimum (h100)", run_blp, quick=False),
        Part("scaling", "Explorer time against graph size", run_scaling),
        Part("scale", "Planning time per instruction at scale", run_scale, quick=False),
    ),
    arguments=arguments,
)
