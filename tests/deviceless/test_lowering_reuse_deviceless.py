"""The pass's lowering once per distinct kernel, and its row-layout proofs once per
distinct part, change nothing it delivers: a small two-layer GPT-2-style training step
(bench.real_steps at tiny sizes) compiled deviceless for an H100 with and without the reuse
places the same kernels (same Kernel IR up to buffer names, bound to the same values),
prices the same module and builds the same PTX."""
from __future__ import annotations

import re

import pytest

from stitch.codegen import lowering_reuse
from stitch.codegen.gpu_cache import canonical_kernel, kernel_ir_text
from stitch.xla_pass import deviceless, pass_planning

from .conftest import TARGET

pytest.importorskip("jax")

TINY = dict(batch=2, seq=32, d_model=64, heads=2, mlp=128, vocab=128)


def _normalized(kernel) -> str:
    canonical = canonical_kernel(kernel)
    text = kernel_ir_text(canonical)
    buffers = [b.name for b in (*canonical.params, *canonical.shared, *canonical.scratch)]
    position = {repr(n): f"'#{i}'" for i, n in enumerate(buffers)}
    return re.sub("|".join(re.escape(q) for q in position), lambda m: position[m.group(0)],
                  text)


def _compile(reuse: bool, monkeypatch: pytest.MonkeyPatch):
    from bench import real_steps
    from stitch.codegen import row_layout
    monkeypatch.setattr(pass_planning, "REUSE_LOWERING", reuse)
    monkeypatch.setattr(row_layout, "REUSE_ROW_LAYOUTS", reuse)
    lowering_reuse.forget_lowerings()
    cfg = real_steps.config("gpt2", 2, **TINY)
    result = deviceless.compile_with_pass(real_steps.lower_for(cfg, TARGET), "tiny_gpt2",
                                          TARGET)
    report = result.report
    kernels = {b.name: (_normalized(b.lowered.kernel), b.lowered.kernel.name,
                        b.lowered.inputs, b.lowered.outputs, b.lowered.initial,
                        b.lowered.layouts, b.lowered.schemes)
               for b in report.kernels}
    return report, kernels


def test_reuse_delivers_the_same_kernels_module_and_price(deviceless_ready, monkeypatch,
                                                          tmp_path) -> None:
    # Every kernel built whatever its saving at these sizes; a fresh plan and build cache.
    monkeypatch.setenv("STITCH_PAYBACK_STEPS", "off")
    monkeypatch.setenv("STITCH_CACHE_DIR", str(tmp_path))
    plain, plain_kernels = _compile(False, monkeypatch)
    reused, reused_kernels = _compile(True, monkeypatch)
    assert plain.lowerings["lowerings_reused"] == 0
    # Repeated layers: kernels were bound, not lowered.
    assert reused.lowerings["lowerings_reused"] > 0
    assert reused_kernels == plain_kernels and plain_kernels
    assert reused.placed == plain.placed
    assert reused.delivery.summary() == plain.delivery.summary()
    assert sorted(reused.skipped) == sorted(plain.skipped)
    # The same PTX per kernel (up to the kernel's own name).
    for a, b in zip(plain.kernels, reused.kernels):
        assert a.name == b.name
        assert a.target.ptx and _no_names(a.target.ptx, a.lowered.kernel) == \
            _no_names(b.target.ptx, b.lowered.kernel)


def _no_names(ptx: str, kernel) -> str:
    for b in (*kernel.params, *kernel.scratch):
        ptx = ptx.replace(b.name, "#")
    return ptx.replace(kernel.name, "@")
