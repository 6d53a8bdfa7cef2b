"""The LLVM pipelines stitch can build GPU kernels with (``stitch.codegen.nvptx.emit_ptx``).

Plain Python, no llvmlite: bench/opt_levels' GPU step, which runs on a machine with only numpy
and cupy, reads the same table.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlvmPipeline:
    """How `emit_ptx` has LLVM build a kernel: LLVM's speed level, whether it unrolls loops,
    whether the kernel's inputs are `noalias`, and whether GVN looks through memory. The
    default is what stitch builds with; the others are for weighing build time against
    kernel speed (bench/opt_levels.py: O3's unrolling is about a third of a GPU build), and
    can be chosen by name with ``STITCH_LLVM_PIPELINE`` (``PIPELINES``).

    ``noalias_inputs``: inputs then load through the read-only path (`ld.global.nc`, as
    XLA's own kernels) and LLVM need not assume an output's store clobbers them: 12% less
    LLVM time on transformer_train's kernels. Off by default: on `.nc` loads ptxas trades
    registers for occupancy and spills some kernels (transformer_train's zoo kernel k101
    on sm_90: 40 registers without spills, 32 with 16 bytes spilled); only a GPU can say
    which runs faster. Kernels that add in place (`kir.has_atomics`) never get it.

    ``gvn_memdep``: GVN's memory-dependence analysis (LLVM's ``-enable-gvn-memdep``), which
    finds loads redundant by looking back through the stores before them; without it LLVM
    took about a fifth less time on transformer_train tiny's kernels (2.46 → 1.91 s) and
    some kernels keep loads it would have removed. LLVM reads the setting process-wide:
    `emit_ptx` sets it for the build and puts it back, so builds of different settings must
    not run at once in one process (the PTX children build one kernel at a time)."""
    speed_level: int = 3
    loop_unrolling: bool = True
    noalias_inputs: bool = False
    gvn_memdep: bool = True


DEFAULT_PIPELINE = LlvmPipeline()

# The pipelines ``STITCH_LLVM_PIPELINE`` may name (and bench/opt_levels builds): the first is
# the default. Each but the default changes some kernels' machine code.
PIPELINES: dict[str, LlvmPipeline] = {
    "O3": DEFAULT_PIPELINE,
    "O3-no-unroll": LlvmPipeline(loop_unrolling=False),
    "O2": LlvmPipeline(speed_level=2),
    "O3-noalias": LlvmPipeline(noalias_inputs=True),
    "O3-no-memdep": LlvmPipeline(gvn_memdep=False),
    "O2-no-unroll-no-memdep": LlvmPipeline(speed_level=2, loop_unrolling=False,
                                           gvn_memdep=False),
}
PIPELINE_ENV = "STITCH_LLVM_PIPELINE"
