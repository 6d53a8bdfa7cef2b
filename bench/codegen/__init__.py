"""Measure ``codegen``: the quality of the generated GPU code, counted from PTX and ptxas
(registers, spills, vector access, row walks, code size) and the cost of the LLVM pipeline.
Parts that assemble need ptxas (the CUDA venv); without it they say so."""
from __future__ import annotations

from bench.measure import Context, Measure, Part, script
from bench.report import block_body


def run_pipelines(ctx: Context) -> list[str] | None:
    """The LLVM pipelines' build cost from the kernels ``python -m bench.opt_levels prepare``
    wrote (``.gpu_bench/``); their device times come from scripts/gpu_check.sh."""
    from pathlib import Path
    manifest = Path(".gpu_bench") / "manifest.json"
    if not manifest.exists():
        if ctx.out is not None and block_body(ctx.out, "bench-codegen-pipelines"):
            return None         # the block keeps the numbers of the last prepared build
        return ["**Not measured here: no `.gpu_bench/manifest.json`** — "
                "`python -m bench.opt_levels prepare` builds the kernels under each pipeline "
                "(about 10 minutes) and this part reads them."]
    return script("bench.opt_levels", ["report"], block="bench-opt-levels")(ctx)


MEASURE = Measure(
    name="codegen",
    title="Code generation: registers, spills, vector access, code size (counted)",
    summary="What the generated kernels look like once assembled: the register estimate "
            "against ptxas, kernels rebuilt with another schedule on ptxas's feedback, "
            "vector loads and stores, split row reductions walked as one row, the code budget "
            "of the GPU path, GEMM-chain kernels under ptxas, the LLVM pipelines' build "
            "cost, and the LLVM build CPU of the lean IR against the IR as written. Counted "
            "from PTX and ptxas output unless a line says modeled.",
    parts=(
        Part("registers", "Register estimate against ptxas",
             script("bench.codegen.registers", [], ["--targets", "h100", "--models", "softmax"],
                    block="regs-vs-ptxas"), quick=False),
        Part("schedule-feedback", "Kernels rebuilt with another schedule on ptxas's feedback",
             script("bench.codegen.schedule_feedback", [],
                    ["--targets", "h100", "--models", "softmax"], block="bench-ptxas-feedback"),
             quick=False),
        Part("vector-access", "The tuner's vector width in the generated code",
             script("bench.codegen.vector_access", ["--ptxas"], [],
                    block="bench-vector-access"), quick=False),
        Part("row-walks", "Split row reductions walked as one row",
             script("bench.codegen.row_walks", [], ["--no-ptxas"], block="bench-split-rows"),
             quick=False),
        Part("code-budget", "Code budget on the GPU path",
             script("bench.codegen.code_budget", [], ["--configs", "tiny"],
                    block="bench-code-budget")),
        Part("gemm-chain-ptxas", "GEMM-chain kernels under ptxas",
             script("bench.codegen.gemm_chain_ptxas", block="bench-gemm-chain-ptxas"),
             quick=False),
        Part("gemm-chain-registers", "GEMM-chain register model against ptxas",
             script("bench.codegen.gemm_chain_registers", [], ["--per", "1"],
                    block="bench-gemm-chains-registers"), quick=False),
        Part("pipelines", "LLVM pipeline of the GPU kernels: build cost", run_pipelines),
        Part("llvm-build-cpu", "LLVM build CPU of the GPU kernels: the IR as written against "
             "the lean IR",
             script("bench.codegen.llvm_build_cpu", [],
                    ["--reps", "1", "--hlo",
                     "hlo_fixtures/data/bert_layer_train_bf16/tiny.gpu-h100.hlo"],
                    block="bench-codegen-llvm-build-cpu"), quick=False),
    ),
)
