"""Where the committed HLO fixtures live and how tests enumerate them."""
from __future__ import annotations

import pathlib

DATA = pathlib.Path(__file__).resolve().parent / "data"
GPU_TARGETS = ("v100", "a100", "h100")


def zoo_fixture_files() -> list[pathlib.Path]:
    """Every jax zoo fixture: tests/data/<model>/<config>.<stage>.hlo."""
    return sorted(p for p in DATA.glob("*/*.hlo") if p.parent.name != "tf")


def tf_fixture_files() -> list[pathlib.Path]:
    return sorted((DATA / "tf").glob("*.hlo")) + sorted((DATA / "tf").glob("*.optimized_hlo"))


def all_fixture_files() -> list[pathlib.Path]:
    return zoo_fixture_files() + tf_fixture_files()


def fixture_id(path: pathlib.Path) -> str:
    return f"{path.parent.name}/{path.name}"


# Relative error allowed where a module computes in bf16 (the zoo's *_bf16 variants): bf16
# keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3) and XLA rounds every bf16 op's result,
# so two correct evaluations that round at other points (fused or not, f32 sums in another
# order) differ by a few roundoffs per value; 2e-2 is about ten.
BF16_TOLERANCE = 2e-2


def uses_bf16(module) -> bool:
    """Whether any instruction of ``module`` (an hlo_passes HloModule) yields bf16."""
    return any(i.shape.is_array and i.shape.element_type == "bf16"
               for _, i in module.instructions())


def zoo_fixture(model: str, config: str, stage: str) -> pathlib.Path:
    """``stage`` is 'pre' or 'gpu-<target>'."""
    return DATA / model / f"{config}.{stage}.hlo"


# add/max reducer computations for hand-written test modules: "HloModule m" + REDUCERS.
REDUCERS = """add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
max {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] maximum(a, b)
}
"""


def compile_with_cpu_pass(fn, *args, name: str | None = None, **jit_kwargs):
    """``jax.jit(fn, **jit_kwargs)`` compiled by XLA CPU with stitch's pass on for it (the
    pass plans for an H100): (the pass's report, the compiled executable)."""
    import jax

    from stitch.xla_pass import entry as xla_pass
    xla_pass.ensure_registered("cpu")
    request = xla_pass.PassRequest(name or fn.__name__, "h100", "cpu")
    lowered = request.prepare(jax.jit(fn, **jit_kwargs).lower(*args))
    with request:
        compiled = lowered.compile()
    return request.result(), compiled
