"""Schedules sized for many registers per thread give ptxas their budget (PTX .maxnreg):
ptxas's own heuristic spilled bert_layer_train's 32-thread layer-norm-backward kernel at 80
registers (128 bytes) where the schedule had planned 127 (tests/test_compile.py's no-spill
check on bert_layer_train a100/h100 failed)."""
from __future__ import annotations

import dataclasses

import pytest

from stitch.codegen import kir
from stitch.codegen.errors import CodegenError
from stitch.codegen.lower import REGISTER_HINT_ABOVE, register_budget
from stitch.codegen.nvptx import emit_ptx
from stitch import compiler
from tests.fixtures import zoo_fixture


@dataclasses.dataclass
class _Occupancy:
    blocks_per_sm: int


@dataclasses.dataclass
class _Schedule:
    block: int
    regs_estimate: int
    occupancy: _Occupancy


@pytest.mark.parametrize("block, blocks, estimate, want", [
    (32, 16, 127, 128),     # 65536 / (32 x 16) registers for each thread
    (128, 3, 160, 168),     # 170 rounded down to ptxas's granularity of 8
    (32, 8, 250, 255),      # at most 255
    (256, 4, REGISTER_HINT_ABOVE, None),   # not above the hint floor: ptxas chooses
    (1024, 1, 100, None),   # 64 left per thread: below the estimate, no hint
    (32, 0, 127, None),     # no occupancy
])
def test_register_budget(block, blocks, estimate, want):
    assert register_budget(_Schedule(block, estimate, _Occupancy(blocks))) == want


def test_budget_is_validated():
    k = kir.Kernel("k", (kir.Param("out", "f32", 4, True),), (), 1, 32, (), register_budget=8)
    with pytest.raises(CodegenError, match="register budget 8"):
        k.validate()


def test_the_bert_layer_norm_backward_kernel_carries_its_budget_to_ptx():
    exe = compiler.compile(zoo_fixture("bert_layer_train", "tiny", "pre").read_text(), "h100",
                           cache=False)
    budgets = {k.name: k.lowered.kernel.register_budget for k in exe.kernels}
    hinted = [name for name, b in budgets.items() if b is not None]
    assert hinted, budgets
    for k in exe.kernels:
        ptx = emit_ptx(k.lowered.kernel, "sm_90")
        budget = budgets[k.name]
        assert (f".maxnreg {budget}" in ptx) if budget else (".maxnreg" not in ptx), k.name
