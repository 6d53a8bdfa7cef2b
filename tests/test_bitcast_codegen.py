"""Same-width bitcast-convert is a bit reinterpretation in codegen (dropout's u32 random bits
as f32), and a convert stays a value conversion: each compared with the reference evaluator
and with jax on fresh random inputs."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.codegen.errors import CodegenError
from stitch.codegen.lower import lower_kernel, run_on_host
from stitch.codegen.values import reinterpret_problem
from stitch.hlo import evaluate, parse_hlo
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph import build_op_graphs
from stitch.cost.gpu_specs import get_spec
from stitch.schedule.tuner import ScheduleError, schedule_kernel


def _module(op: str, src: str, dst: str, n: int) -> str:
    # XLA writes a same-width bitcast-convert as `bitcast` once simplified (the dropout
    # mask's u32 -> f32 in keras_hub's GPT2 step): both spellings.
    return f"""HloModule m
ENTRY e {{
  x = {src}[{n}] parameter(0)
  one = {src}[] constant(1)
  b1 = {src}[{n}] broadcast(one), dimensions={{}}
  y = {src}[{n}] add(x, b1)
  c = {dst}[{n}] {op}(y)
  two = {dst}[] constant(2)
  b2 = {dst}[{n}] broadcast(two), dimensions={{}}
  ROOT r = {dst}[{n}] multiply(c, b2)
}}"""


def _run(text: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    module = parse_hlo(text)
    graph = build_op_graphs(module)[0]
    members = frozenset(n.id for n in graph.nodes
                        if n.opcode not in ("parameter", "constant"))
    schedule = schedule_kernel(graph, members, get_spec("h100"))
    lowered = lower_kernel(graph, Evaluator(module), schedule, "k_bitcast")
    param = next(n.id for n in graph.nodes if n.opcode == "parameter")
    root = next(n.id for n in graph.nodes if n.name == "r")
    got = run_on_host(lowered, graph, {param: x})[root]
    (want,) = evaluate(module, [x])
    return got, want


def _bits(rng, n):
    # u32 bits of finite f32 values (a NaN's payload may not survive the multiply).
    return rng.standard_normal(n).astype(np.float32).view(np.uint32) - np.uint32(1)


@pytest.mark.parametrize("op", ["bitcast", "bitcast-convert"])
def test_u32_bits_are_reinterpreted_as_f32(op):
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng()
    n = int(rng.integers(8, 200))
    x = _bits(rng, n)
    got, want = _run(_module(op, "u32", "f32", n), x)
    reference = np.asarray(jax.lax.bitcast_convert_type(jax.numpy.asarray(x + np.uint32(1)),
                                                        jax.numpy.float32)) * 2
    np.testing.assert_array_equal(want, reference)
    np.testing.assert_array_equal(got, want)
    # A value conversion would give the integers' magnitudes: never that.
    assert not np.allclose(got, (x + np.uint32(1)).astype(np.float32) * 2)


def test_f32_bits_are_reinterpreted_as_s32():
    rng = np.random.default_rng()
    n = int(rng.integers(8, 200))
    x = rng.standard_normal(n).astype(np.float32)
    got, want = _run(_module("bitcast-convert", "f32", "s32", n), x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, (x + 1).view(np.int32) * 2)


def test_a_convert_still_converts_values():
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng()
    n = int(rng.integers(8, 200))
    x = rng.integers(0, 1 << 20, n).astype(np.uint32)
    got, want = _run(_module("convert", "u32", "f32", n), x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, np.asarray(
        jax.numpy.asarray(x + np.uint32(1)).astype(jax.numpy.float32)) * 2)


def test_reinterpretations_codegen_cannot_hold_are_refused_not_converted():
    assert reinterpret_problem("u32", "f32") is None
    assert reinterpret_problem("f16", "u16") is not None      # f16 is widened to f32
    assert reinterpret_problem("f32", "f64") is not None      # widths differ
    n = 16
    text = _module("bitcast-convert", "f32", "f32", n).replace(
        "c = f32[16] bitcast-convert(y)", "c = f64[16] bitcast-convert(y)")
    module = parse_hlo(text.replace("two = f32[]", "two = f64[]")
                       .replace("b2 = f32[16]", "b2 = f64[16]")
                       .replace("ROOT r = f32[16]", "ROOT r = f64[16]"))
    graph = build_op_graphs(module)[0]
    members = frozenset(n.id for n in graph.nodes if n.opcode not in ("parameter", "constant"))
    # Refused, by the planner's feasibility (the same rule) before codegen is asked.
    with pytest.raises((CodegenError, ScheduleError), match="differ in width"):
        schedule = schedule_kernel(graph, members, get_spec("h100"))
        lower_kernel(graph, Evaluator(module), schedule, "k_refused")
