"""ptxas on the GEMM chain kernels (stitch.codegen.gemm_chain) of MCFuser's chains and attention
modules at full size: registers, spills and shared memory per model, f32 (FMA tiles) and
bf16 (tensor cores; the fixture's f32 types replaced by bf16), sm_80 and sm_90, with the
default tiling (``ChainTiling.default_for``).

``python -m bench.codegen.gemm_chain_ptxas [--out docs/benchmarks.md]`` (about a minute; needs
ptxas and libdevice, no GPU). Counted by ptxas, not measured on a device.
"""
from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from bench.report import REPO, publish, stamp
from stitch.codegen.gemm_chain import ChainTiling, lower_gemm_chain
from stitch.codegen.nvptx import emit_ptx
from stitch.codegen.toolchain import assemble
from stitch.hlo.gemm_chains import find_gemm_chains
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.parser import parse_hlo
from stitch.models.mcfuser import ATTENTIONS, GEMM_CHAINS

SECTION = "bench-gemm-chain-ptxas"
DATA = REPO / "hlo_fixtures" / "data"
ARCHS = ("sm_80", "sm_90")


def _tiles(t: ChainTiling) -> str:
    core = "mma" if t.mma else f"{t.thread_m}x{t.thread_n}"
    return f"{t.block_m}x{t.block_n}x{t.block_k}, h{t.block_h}, {t.threads}t, {core}"


def rows() -> list[str]:
    models = [f"gemm_chain_{g}" for g in GEMM_CHAINS] + [f"attention_{a}" for a in ATTENTIONS]
    out = []
    for model in models:
        text = (DATA / model / "full.gpu-h100.hlo").read_text()
        cells = []
        for dtype in ("f32", "bf16"):
            if dtype != "f32":
                text = re.sub(r"\bf32\[", f"{dtype}[", text)
            graph = build_op_graphs(parse_hlo(text))[0]
            (chain,) = find_gemm_chains(graph)
            for arch in ARCHS:
                tiling = ChainTiling.default_for(chain, arch)
                kernel = lower_gemm_chain(graph, chain, tiling, name="chain", arch=arch).kernel
                report = assemble(emit_ptx(kernel, arch), arch, kernel_name="chain")["chain"]
                spills = report.spill_store_bytes + report.spill_load_bytes
                cells.append(f"{report.registers}" + (f" (spills {spills} B)" if spills else ""))
            cells.append(_tiles(tiling))
        dims = f"{chain.batch}x{chain.m}x{chain.n}x{chain.k}x{chain.h}"
        out.append(f"| {model} | {dims} | {'yes' if chain.softmax else 'no'} | "
                   + " | ".join(cells) + " |")
    return out


def section(command: str) -> str:
    start = time.perf_counter()
    table = rows()
    return "\n".join([
        "## GEMM chain kernels under ptxas (counted)",
        "",
        stamp(command),
        "",
        "One kernel per chain, default tiling per arch; registers per thread from "
        "`ptxas -v`, no spills unless noted. dims = batch x M x N x K x H. f32 runs "
        "register-tiled FMA; bf16 runs `mma.sync.m16n8k16` tensor cores (fixture types "
        "replaced by bf16).",
        "",
        "| model | dims | softmax | f32 sm_80 | f32 sm_90 | f32 tiles | bf16 sm_80 | "
        "bf16 sm_90 | bf16 tiles |",
        "|---|---|---|---|---|---|---|---|---|",
        *table,
        "",
        f"({time.perf_counter() - start:.0f} s.)",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    command = "python -m bench.codegen.gemm_chain_ptxas" + (f" --out {args.out}" if args.out else "")
    body = section(command)
    publish(args.out, SECTION, body)


if __name__ == "__main__":
    main()
