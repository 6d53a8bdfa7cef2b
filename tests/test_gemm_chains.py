"""GEMM chain recognition (stitch.hlo.gemm_chains) on the zoo's MCFuser fixtures.

Every gemm_chain_g* / attention_* fixture (full and tiny, XLA's GPU plans for V100 / A100 /
H100 and jax's own form) holds exactly one chain with the dims of MCFuser's tables
(stitch.models.mcfuser). On tiny fixtures the recognized chain (operand views + element
program) is run in numpy on fresh random inputs and must match the reference evaluator:
a wrong stride, a lost scale or a softmax over the wrong dim fails there.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from stitch.hlo.evaluator import evaluate
from stitch.hlo.gemm_chains import (GemmChain, OperandView, chain_of, find_gemm_chains,
                                           softmax_parts)
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.op_classes import OpClass
from stitch.hlo.parser import parse_hlo
from stitch.models.mcfuser import ATTENTIONS, GEMM_CHAINS, ChainShape
from tests.fixtures import DATA

STAGES = ("gpu-v100", "gpu-a100", "gpu-h100", "pre")
MODELS = sorted([f"gemm_chain_{g}" for g in GEMM_CHAINS] + [f"attention_{a}" for a in ATTENTIONS])


def _shape(model: str, config: str) -> ChainShape:
    if model.startswith("gemm_chain_"):
        shape = GEMM_CHAINS[model[len("gemm_chain_"):]]
    else:
        shape = ATTENTIONS[model[len("attention_"):]][2]
    return shape.tiny() if config == "tiny" else shape


def _load(model: str, config: str, stage: str):
    module = parse_hlo((DATA / model / f"{config}.{stage}.hlo").read_text())
    return module, build_op_graphs(module)[0]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("config", ("full", "tiny"))
@pytest.mark.parametrize("model", MODELS)
def test_one_chain_with_the_tables_dims(model: str, config: str, stage: str) -> None:
    _, graph = _load(model, config, stage)
    chains = find_gemm_chains(graph)
    assert len(chains) == 1, [c.members for c in chains]
    chain = chains[0]
    s = _shape(model, config)
    assert (chain.batch, chain.m, chain.n, chain.k, chain.h) == (s.batch, s.m, s.n, s.k, s.h)
    assert chain.softmax == model.startswith("attention_")
    assert chain.operand_dtype == "f32"
    computes = [v for v in chain.members if graph.nodes[v].op_class is OpClass.COMPUTE]
    assert computes == [chain.first, chain.second]
    # Everything that is not a parameter is inside: the kernel reads the three operands.
    assert sorted(chain.inputs) == sorted(graph.inputs)
    assert set(chain.between) <= set(chain.members)
    assert chain.output in chain.members
    assert graph.is_convex(chain.members)
    # The XLA plan's non-free ops all belong to the chain (split-K reduces included).
    work = {n.id for n in graph.nodes if not graph.is_free(n.id)}
    assert work <= set(chain.members)
    assert chain_of(graph, chain.members) == chain
    core = tuple(v for v in chain.members if not graph.is_free(v))
    assert chain_of(graph, core) == chain
    assert chain_of(graph, tuple(v for v in chain.members if v != chain.second)) is None


# ----------------------------------------------------------------------- numpy replay


def _gather(flat: np.ndarray, view: OperandView, dims: tuple[int, int, int]) -> np.ndarray:
    b, r, c = (np.arange(d) for d in dims)
    batch = np.array([view.batch_offset(int(x)) for x in b])
    index = (batch[:, None, None] + r[None, :, None] * view.row_stride
             + c[None, None, :] * view.col_stride)
    return flat[index]


_NUMPY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
          "divide": np.divide, "maximum": np.maximum, "minimum": np.minimum,
          "exponential": np.exp, "negate": np.negative, "tanh": np.tanh, "log": np.log}
_REDUCE = {"add": np.sum, "maximum": np.max, "minimum": np.min, "multiply": np.prod}


def replay(chain: GemmChain, values: dict[int, np.ndarray]) -> np.ndarray:
    """The chain's result computed from its views and program in float64."""
    flat = {v: np.asarray(x, np.float64).reshape(-1) for v, x in values.items()}
    bmn = (chain.batch, chain.m, chain.n)
    a = _gather(flat[chain.a.node], chain.a, (chain.batch, chain.m, chain.k))
    b = _gather(flat[chain.b.node], chain.b, (chain.batch, chain.k, chain.n))
    c = _gather(flat[chain.c.node], chain.c, (chain.batch, chain.n, chain.h))
    vals: list[np.ndarray] = []
    for op in chain.program:
        if op.kind == "acc":
            vals.append(a @ b)
        elif op.kind == "const":
            vals.append(np.float64(op.value))
        elif op.kind == "input":
            cols = chain.n if op.rank == "tile" else 1
            vals.append(_gather(flat[op.view.node], op.view, (chain.batch, chain.m, cols)))
        elif op.kind == "reduce":
            vals.append(_REDUCE[op.opcode](vals[op.args[0]], axis=2, keepdims=True))
        else:
            vals.append(_NUMPY[op.opcode](*(vals[i] for i in op.args)))
    p = np.broadcast_to(vals[-1], bmn)
    return p @ c


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("model", MODELS)
def test_tiny_chain_replays_to_the_evaluator(model: str, stage: str) -> None:
    module, graph = _load(model, "tiny", stage)
    chain = find_gemm_chains(graph)[0]
    rng = np.random.default_rng(abs(hash((model, stage))) % 2**32)
    args = [rng.standard_normal(p.shape.dims).astype(np.float32)
            for p in module.entry.parameters]
    want = evaluate(module, args)[0].reshape(-1)
    # graph.inputs follow the graph's node order, not parameter numbers.
    values = {v: args[graph.nodes[v].instruction.parameter_number] for v in graph.inputs}
    got = replay(chain, values).reshape(-1)
    assert math.prod(got.shape) == want.size
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_softmax_parts_name_the_pieces() -> None:
    _, graph = _load("attention_bert_base", "tiny", "gpu-v100")
    chain = find_gemm_chains(graph)[0]
    parts = softmax_parts(chain.program)
    assert parts is not None and parts.p == len(chain.program) - 1
    program = chain.program
    assert program[parts.row_max].opcode == "maximum"
    assert program[parts.row_sum].opcode == "add"
    # cuBLAS alpha (1/sqrt(d) = 0.5) scales the first GEMM's sum before the softmax.
    scale = program[parts.x]
    assert scale.opcode == "multiply" and program[scale.args[1]].value == 0.5


# ----------------------------------------------------------------------- negatives

_CHAIN = """HloModule m
ENTRY e {
  a = f32[2,8,4] parameter(0)
  b = f32[2,4,8] parameter(1)
  c = f32[2,8,6] parameter(2)
  s = f32[2,8,8] dot(a, b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  t = f32[2,8,8] tanh(s)
  ROOT o = f32[2,8,6] dot(t, c), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""


def _chains(text: str) -> list[GemmChain]:
    return find_gemm_chains(build_op_graphs(parse_hlo(text))[0])


def test_handwritten_chain_is_found() -> None:
    (chain,) = _chains(_CHAIN)
    assert (chain.batch, chain.m, chain.n, chain.k, chain.h) == (2, 8, 8, 4, 6)
    assert not chain.softmax
    assert [op.opcode for op in chain.program] == ["", "tanh"]


def test_first_result_read_elsewhere_is_not_a_chain() -> None:
    text = _CHAIN.replace("ROOT o = f32[2,8,6] dot", "o = f32[2,8,6] dot").replace(
        "\n}\n", "\n  ROOT r = (f32[2,8,6], f32[2,8,8]) tuple(o, s)\n}\n")
    assert _chains(text) == []


def test_between_value_read_elsewhere_is_not_a_chain() -> None:
    text = _CHAIN.replace("ROOT o = f32[2,8,6] dot", "o = f32[2,8,6] dot").replace(
        "\n}\n", "\n  ROOT r = (f32[2,8,6], f32[2,8,8]) tuple(o, t)\n}\n")
    assert _chains(text) == []


def test_second_dot_contracting_m_is_not_a_chain() -> None:
    text = _CHAIN.replace("ROOT o = f32[2,8,6] dot(t, c), lhs_batch_dims={0}, "
                          "lhs_contracting_dims={2}",
                          "ROOT o = f32[2,8,6] dot(t, c), lhs_batch_dims={0}, "
                          "lhs_contracting_dims={1}")
    assert _chains(text) == []


def test_transpose_between_is_not_a_chain() -> None:
    text = _CHAIN.replace("t = f32[2,8,8] tanh(s)",
                          "t = f32[2,8,8] transpose(s), dimensions={0,2,1}")
    assert _chains(text) == []


def test_reduction_over_m_is_not_a_chain() -> None:
    text = """HloModule m
add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}
ENTRY e {
  a = f32[2,8,4] parameter(0)
  b = f32[2,4,8] parameter(1)
  c = f32[2,8,6] parameter(2)
  s = f32[2,8,8] dot(a, b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  z = f32[] constant(0)
  r = f32[2,8] reduce(s, z), dimensions={1}, to_apply=add
  rb = f32[2,8,8] broadcast(r), dimensions={0,2}
  t = f32[2,8,8] divide(s, rb)
  ROOT o = f32[2,8,6] dot(t, c), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""
    assert _chains(text) == []
    # The same with the reduction over n is one.
    fixed = text.replace("dimensions={1}, to_apply", "dimensions={2}, to_apply").replace(
        "broadcast(r), dimensions={0,2}", "broadcast(r), dimensions={0,1}")
    assert len(_chains(fixed)) == 1


def test_rhs_computed_from_first_gemm_is_not_a_chain() -> None:
    text = _CHAIN.replace("c = f32[2,8,6] parameter(2)", "c0 = f32[2,8,6] parameter(2)").replace(
        "t = f32[2,8,8] tanh(s)",
        "t = f32[2,8,8] tanh(s)\n  c = f32[2,8,6] slice(s), slice={[0:2], [0:8], [0:6]}")
    assert _chains(text) == []


# ----------------------------------------------------------------------- real programs


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("config", ("full", "tiny"))
def test_bert_layer_attention_is_a_chain(config: str, stage: str) -> None:
    """The BERT layer's attention: Q/K/V transposed from the projections ([B, L, H, D] to
    [B, H, L, D]) and the additive key mask broadcast over heads and query rows are read
    through strided views (the transposes and broadcasts join the chain), b = B x H."""
    module, graph = _load("bert_layer_infer", config, stage)
    chains = find_gemm_chains(graph)
    attention = [c for c in chains if c.softmax]
    assert len(attention) == 1
    chain = attention[0]
    batch, heads, length, head_dim = (32, 12, 128, 64) if config == "full" else (2, 4, 8, 8)
    assert (chain.batch, chain.m, chain.n, chain.k, chain.h) == (
        batch * heads, length, length, head_dim, head_dim)
    masks = [op.view for op in chain.program if op.kind == "input"]
    assert len(masks) == 1              # v100's three mask broadcasts are one value
    mask = masks[0]
    assert graph.is_free(mask.node)     # the mask parameter (or a bitcast of it)
    assert mask.batch_dims == ((batch, length), (heads, 0)) and mask.row_stride == 0
    assert graph.is_convex(chain.members)
    if stage == "pre":                  # jax's form: the FFN (dense, GELU, dense) too
        (ffn,) = [c for c in chains if not c.softmax]
        hidden = 768 if config == "full" else 32
        assert (ffn.m, ffn.k, ffn.h) == (batch * length, hidden, hidden)


SELF_ATTENTION = """HloModule self_attention
add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}
max {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] maximum(x, y)
}
ENTRY e {
  x = f32[2,8,8] parameter(0)
  s = f32[2,8,8] dot(x, x), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={2}
  ninf = f32[] constant(-inf)
  mx = f32[2,8] reduce(s, ninf), dimensions={2}, to_apply=max
  mxb = f32[2,8,8] broadcast(mx), dimensions={0,1}
  d = f32[2,8,8] subtract(s, mxb)
  ex = f32[2,8,8] exponential(d)
  zero = f32[] constant(0)
  sm = f32[2,8] reduce(ex, zero), dimensions={2}, to_apply=add
  smb = f32[2,8,8] broadcast(sm), dimensions={0,1}
  p = f32[2,8,8] divide(ex, smb)
  ROOT o = f32[2,8,8] dot(p, x), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""


def test_operand_read_twice_is_one_input() -> None:
    """softmax(X X^T) X: A, B and C are one buffer, so the kernel has one input."""
    (chain,) = _chains(SELF_ATTENTION)
    assert chain.softmax and len(chain.inputs) == 1
    assert chain.a.node == chain.b.node == chain.c.node == chain.inputs[0]
    assert (chain.b.row_stride, chain.b.col_stride) == (1, 8)      # B = X^T
