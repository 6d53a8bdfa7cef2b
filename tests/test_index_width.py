"""Index arithmetic is 32-bit: a kernel whose buffers reach 2^31 elements would compute
wrapping offsets (an illegal address on a GPU). Such kernels are refused with the reason and
left to XLA / the evaluator."""
from __future__ import annotations

import pytest

from stitch.codegen.errors import CodegenError
from stitch.codegen.kir import MAX_INDEX_ELEMENTS, Kernel, Param

# GPT-2 logits at 64k tokens: f32[65536,50257] = 3.3e9 elements.
SOFTMAX_64K = """HloModule softmax64k

max_f32 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT m = f32[] maximum(a, b)
}

add_f32 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

ENTRY main {
  x = f32[65536,50257] parameter(0)
  ninf = f32[] constant(-inf)
  mx = f32[65536] reduce(x, ninf), dimensions={1}, to_apply=max_f32
  mxb = f32[65536,50257] broadcast(mx), dimensions={0}
  d = f32[65536,50257] subtract(x, mxb)
  e = f32[65536,50257] exponential(d)
  zero = f32[] constant(0)
  s = f32[65536] reduce(e, zero), dimensions={1}, to_apply=add_f32
  sb = f32[65536,50257] broadcast(s), dimensions={0}
  ROOT y = f32[65536,50257] divide(e, sb)
}
"""


def test_softmax_over_2_31_elements_is_refused_with_its_reason() -> None:
    import stitch
    exe = stitch.compile(SOFTMAX_64K, target="h100")
    assert exe.fallbacks, "a 3.3e9-element softmax was built with 32-bit index math"
    for fallback in exe.fallbacks:
        assert "2^31" in fallback.reason, fallback
    assert not exe.ptx, "PTX emitted for a kernel whose offsets wrap"


def test_thread_count_past_2_31_is_invalid() -> None:
    kernel = Kernel(name="k", params=(Param("x", "f32", 1024),), shared=(), grid=2**22,
                    block=1024, body=())
    with pytest.raises(CodegenError, match="2\\^31"):
        kernel.validate()
    big = Kernel(name="k", params=(Param("x", "f32", MAX_INDEX_ELEMENTS + 1),), shared=(),
                 grid=1, block=32, body=())
    with pytest.raises(CodegenError, match="over 2\\^31 - 1"):
        big.validate()
    ok = Kernel(name="k", params=(Param("x", "f32", MAX_INDEX_ELEMENTS),), shared=(), grid=1,
                block=32, body=())
    ok.validate()
