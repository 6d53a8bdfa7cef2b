"""The chain register model (``stitch.cost.gemm_tile.chain_registers``) against ptxas -v:
per zoo chain (``gemm_chain_*``, ``attention_*``, full size, fixture ``full.gpu-<target>.hlo``)
and target (a100 -> sm_80, h100 -> sm_90), the schedule the Markov search settles on plus
``--per`` random schedules of the pruned space (distinct codegen tilings, seeded), each built
by codegen and assembled; the model's estimate beside ptxas's count and spills.

``python -m bench.codegen.gemm_chain_registers [--per 6] [--out docs/benchmarks.md]`` (about 1 s
of ptxas per schedule: ``--per 6`` is ~5 minutes on the 2-core box). Counted by ptxas, not
measured on a device. The constants of ``chain_registers`` were fitted (least squares on the
schedules below 250 registers) to a sample drawn this way (294 distinct schedules).
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import REPO, publish, stamp
from stitch.codegen.errors import CodegenError
from stitch.codegen.gemm_chain import lower_gemm_chain
from stitch.codegen.nvptx import emit_ptx
from stitch.codegen.toolchain import assemble
from stitch.hlo.gemm_chains import find_gemm_chains
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.parser import parse_hlo
from stitch.pricing.chain_pricing import chain_dims
from stitch.cost.gemm_tile import chain_registers
from stitch.cost.gpu_specs import get_spec
from stitch.models.mcfuser import ATTENTIONS, GEMM_CHAINS
from stitch.schedule.chain_tiling import tiling_for
from stitch.schedule.gemm_chain_space import best_schedule, enumerate_schedules

SECTION = "bench-gemm-chains-registers"
DATA = REPO / "hlo_fixtures" / "data"
TARGETS = (("a100", "sm_80"), ("h100", "sm_90"))
WITHIN = 0.20


@dataclass(frozen=True)
class RegisterRow:
    model: str
    arch: str
    schedule: str
    mma: bool
    planned: bool
    model_registers: int
    ptxas_registers: int
    spill_bytes: int

    @property
    def error(self) -> float:
        return self.model_registers / self.ptxas_registers - 1


def collect(per: int, seed: int = 1) -> list[RegisterRow]:
    rng = random.Random(seed)
    rows: list[RegisterRow] = []
    models = [f"gemm_chain_{g}" for g in GEMM_CHAINS] + [f"attention_{a}" for a in ATTENTIONS]
    for model in models:
        for target, arch in TARGETS:
            graph = build_op_graphs(parse_hlo((DATA / model / f"full.gpu-{target}.hlo")
                                              .read_text()))[0]
            (chain,) = find_gemm_chains(graph)
            spec = get_spec(target)
            dims = chain_dims(graph, chain, tf32=True)
            distinct = {}
            for s in enumerate_schedules(spec, dims):
                distinct.setdefault(tiling_for(s, dims.h), s)
            planned = best_schedule(spec, dims).schedule
            pool = [s for s in distinct.values() if tiling_for(s, dims.h) !=
                    tiling_for(planned, dims.h)]
            for s, is_planned in [(planned, True)] + [(x, False) for x in
                                                      rng.sample(pool, min(per, len(pool)))]:
                try:
                    kernel = lower_gemm_chain(graph, chain, tiling_for(s, chain.h), "chain",
                                              arch).kernel
                    report = assemble(emit_ptx(kernel, arch), arch, kernel_name="chain")["chain"]
                except CodegenError:
                    continue
                rows.append(RegisterRow(model, arch, s.text(), s.mma, is_planned,
                                        chain_registers(dims, s), report.registers,
                                        report.spill_store_bytes + report.spill_load_bytes))
    return rows


def _stats(rows: list[RegisterRow]) -> str:
    if not rows:
        return "–"
    errors = [abs(r.error) for r in rows]
    within = sum(e <= WITHIN for e in errors)
    return (f"{len(rows)} | {sum(errors) / len(errors):.1%} | {max(errors):.0%} | "
            f"{within} ({within / len(rows):.0%}) | {sum(r.spill_bytes > 0 for r in rows)}")


def section(command: str, per: int) -> str:
    start = time.perf_counter()
    rows = collect(per)
    groups = [("planned (the search's schedule, before the ptxas spill check)",
               [r for r in rows if r.planned]),
              ("all MMA", [r for r in rows if r.mma]),
              ("all FMA", [r for r in rows if not r.mma]),
              ("all", rows)]
    lines = [
        "## GEMM chain register model vs ptxas (counted)", "", stamp(command), "",
        "Registers per thread: `stitch.cost.gemm_tile.chain_registers` against `ptxas -v` of "
        "the kernel codegen builds (sm_80 for a100, sm_90 for h100; TF32 MMA where the "
        f"chain's dots allow it), per zoo chain the searched schedule plus {per} random "
        "distinct tilings of the pruned space. Error = model / ptxas - 1.", "",
        f"| schedules | n | mean abs error | max abs error | within ±{WITHIN:.0%} | spilled |",
        "|---|---:|---:|---:|---:|---:|",
        *[f"| {name} | {_stats(group)} |" for name, group in groups], "",
        "| model | arch | planned schedule | model regs | ptxas regs | spills B |",
        "|---|---|---|---:|---:|---:|",
        *[f"| {r.model} | {r.arch} | `{r.schedule}` | {r.model_registers} | "
          f"{r.ptxas_registers} | {r.spill_bytes} |" for r in rows if r.planned], "",
        f"({time.perf_counter() - start:.0f} s.)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    command = f"python -m bench.codegen.gemm_chain_registers --per {args.per}" + (
        f" --out {args.out}" if args.out else "")
    body = section(command, args.per)
    publish(args.out, SECTION, body)


if __name__ == "__main__":
    main()
