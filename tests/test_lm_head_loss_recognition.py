"""Recognizing the LM head + softmax cross-entropy (``hlo/lm_head_loss.py``) in the
form XLA GPU's optimized module gives jax's ``log_softmax`` + ``take_along_axis`` eval loss
(the H100 module of tests/deviceless/test_lm_head_loss_deviceless.py, metadata dropped and
sizes made small): one site, the sum of its rows' log-probabilities the result; the forward kernel
built from it on the host gives the module's loss (the reference evaluator, fresh random
inputs, negative labels included, f32 1e-5). Forms that compute something else are no site;
a logits value read outside makes the site not close (``escapes``)."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.codegen.host import NUMPY_DTYPES, compile_host
from stitch.codegen.lm_head_loss import default_tiling, lower_lm_head_loss
from stitch.hlo.evaluator import evaluate
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.lm_head_loss import find_lm_head_losses
from stitch.hlo.parser import parse_hlo

B, S, D, V = 2, 8, 16, 300
_TEMPLATE = """HloModule lm_head_eval

%gemm_fusion_dot_computation (parameter_0: f32[{R},{D}], parameter_1: f32[{V},{D}]) -> f32[{R},{V}] {{
  %parameter_0 = f32[{R},{D}]{{1,0}} parameter(0)
  %parameter_1 = f32[{V},{D}]{{1,0}} parameter(1)
  ROOT %dot.2 = f32[{R},{V}]{{1,0}} dot(%parameter_0, %parameter_1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}
}}

%region_1.2.clone (reduce_sum.1: f32[], reduce_sum.2: f32[]) -> f32[] {{
  %reduce_sum.2 = f32[] parameter(1)
  %reduce_sum.1 = f32[] parameter(0)
  ROOT %reduce_sum.6.0 = f32[] add(%reduce_sum.1, %reduce_sum.2)
}}

%region_0.1 (reduce_max.3: f32[], reduce_max.4: f32[]) -> f32[] {{
  %reduce_max.4 = f32[] parameter(1)
  %reduce_max.3 = f32[] parameter(0)
  ROOT %reduce_max.5.0 = f32[] maximum(%reduce_max.3, %reduce_max.4)
}}

%triton_softmax_computation.2 (param_0.16: f32[{R},{V}]) -> f32[{B},{S},{V}] {{
  %param_0.16 = f32[{R},{V}]{{1,0}} parameter(0)
  %bitcast.24 = f32[{B},{S},{V}]{{2,1,0}} bitcast(%param_0.16)
  %constant_27 = f32[] constant(-inf)
  %reduce.6 = f32[{R}]{{0}} reduce(%param_0.16, %constant_27), dimensions={{1}}, to_apply=%region_0.1
  %bitcast.23 = f32[{B},{S}]{{1,0}} bitcast(%reduce.6)
  %sub.27 = f32[{B},{S},{V}]{{2,1,0}} broadcast(%bitcast.23), dimensions={{0,1}}
  %sub.26 = f32[{B},{S},{V}]{{2,1,0}} subtract(%bitcast.24, %sub.27)
  %exp.3 = f32[{B},{S},{V}]{{2,1,0}} exponential(%sub.26)
  %constant_23 = f32[] constant(0)
  %reduce_sum.9 = f32[{B},{S}]{{1,0}} reduce(%exp.3, %constant_23), dimensions={{2}}, to_apply=%region_1.2.clone
  %log.4 = f32[{B},{S}]{{1,0}} log(%reduce_sum.9)
  %sub.20 = f32[{B},{S},{V}]{{2,1,0}} broadcast(%log.4), dimensions={{0,1}}
  ROOT %sub.21 = f32[{B},{S},{V}]{{2,1,0}} subtract(%sub.26, %sub.20)
}}

%region_1.2 (reduce_sum.3: f32[], reduce_sum.4: f32[]) -> f32[] {{
  %reduce_sum.4 = f32[] parameter(1)
  %reduce_sum.3 = f32[] parameter(0)
  ROOT %reduce_sum.5.0 = f32[] add(%reduce_sum.3, %reduce_sum.4)
}}

%fused_reduce (param_0.33: f32[{B},{S},{V}], param_1.42: s32[{B},{S}]) -> f32[] {{
  %param_1.42 = s32[{B},{S}]{{1,0}} parameter(1)
  %bitcast.38 = s32[{B},{S},1]{{2,1,0}} bitcast(%param_1.42)
  %constant_3_1 = s32[] constant(0)
  %lt.0.5 = s32[{B},{S},1]{{2,1,0}} broadcast(%constant_3_1), dimensions={{}}
  %lt.1.5 = pred[{B},{S},1]{{2,1,0}} compare(%bitcast.38, %lt.0.5), direction=LT
  %constant_4_1 = s32[] constant({V})
  %add.0.5 = s32[{B},{S},1]{{2,1,0}} broadcast(%constant_4_1), dimensions={{}}
  %add.1.7 = s32[{B},{S},1]{{2,1,0}} add(%bitcast.38, %add.0.5)
  %select_n.0.5 = s32[{B},{S},1]{{2,1,0}} select(%lt.1.5, %add.1.7, %bitcast.38)
  %bitcast.1.17 = s32[{B},{S},1,1]{{3,2,1,0}} bitcast(%select_n.0.5)
  %ge.0.5 = s32[{B},{S},1,1]{{3,2,1,0}} broadcast(%constant_3_1), dimensions={{}}
  %ge.1.5 = pred[{B},{S},1,1]{{3,2,1,0}} compare(%bitcast.1.17, %ge.0.5), direction=GE
  %constant_9_1 = s32[] constant({V1})
  %le.0.5 = s32[{B},{S},1,1]{{3,2,1,0}} broadcast(%constant_9_1), dimensions={{}}
  %le.1.5 = pred[{B},{S},1,1]{{3,2,1,0}} compare(%bitcast.1.17, %le.0.5), direction=LE
  %and.0.3 = pred[{B},{S},1,1]{{3,2,1,0}} and(%ge.1.5, %le.1.5)
  %bitcast.2.3 = pred[{B},{S},1]{{2,1,0}} bitcast(%and.0.3)
  %param_0.33 = f32[{B},{S},{V}]{{2,1,0}} parameter(0)
  %iota.5 = s32[{B},{S},1,1]{{3,2,1,0}} iota(), iota_dimension=0
  %iota.1.3 = s32[{B},{S},1,1]{{3,2,1,0}} iota(), iota_dimension=1
  %concatenate.8 = s32[{B},{S},1,3]{{3,2,1,0}} concatenate(%iota.5, %iota.1.3, %bitcast.1.17), dimensions={{3}}
  %bitcast.6.5 = s32[{R},3]{{1,0}} bitcast(%concatenate.8)
  %gather.3.5 = f32[{R},1,1,1]{{3,2,1,0}} gather(%param_0.33, %bitcast.6.5), offset_dims={{1,2,3}}, collapsed_slice_dims={{}}, start_index_map={{0,1,2}}, index_vector_dim=1, slice_sizes={{1,1,1}}
  %bitcast.7.3 = f32[{B},{S},1]{{2,1,0}} bitcast(%gather.3.5)
  %constant_11_1 = f32[] constant(nan)
  %broadcast_in_dim.4.3 = f32[{B},{S},1]{{2,1,0}} broadcast(%constant_11_1), dimensions={{}}
  %select_n.1.3 = f32[{B},{S},1]{{2,1,0}} select(%bitcast.2.3, %bitcast.7.3, %broadcast_in_dim.4.3)
  %bitcast.15.1 = f32[{R}]{{0}} bitcast(%select_n.1.3)
  %constant_21_1 = f32[] constant(0)
  ROOT %reduce_sum.15.1 = f32[] reduce(%bitcast.15.1, %constant_21_1), dimensions={{0}}, to_apply=%region_1.2
}}

%fused_negate (param_0.30: f32[]) -> f32[] {{
  %param_0.30 = f32[] parameter(0)
  %constant_12_1 = f32[] constant({INV})
  %multiply.2 = f32[] multiply(%param_0.30, %constant_12_1)
  ROOT %neg.1.1 = f32[] negate(%multiply.2)
}}

ENTRY %main.7 (h.1: f32[{B},{S},{D}], emb.1: f32[{V},{D}], labels.1: s32[{B},{S}]) -> f32[] {{
  %labels.1 = s32[{B},{S}]{{1,0}} parameter(2)
  %emb.1 = f32[{V},{D}]{{1,0}} parameter(1)
  %h.1 = f32[{B},{S},{D}]{{2,1,0}} parameter(0)
  %bitcast.9.0 = f32[{R},{D}]{{1,0}} bitcast(%h.1)
  %gemm_fusion_dot = f32[{R},{V}]{{1,0}} fusion(%bitcast.9.0, %emb.1), kind=kCustom, calls=%gemm_fusion_dot_computation
  %triton_softmax.2 = f32[{B},{S},{V}]{{2,1,0}} fusion(%gemm_fusion_dot), kind=kCustom, calls=%triton_softmax_computation.2
  %input_reduce_fusion = f32[] fusion(%triton_softmax.2, %labels.1), kind=kInput, calls=%fused_reduce
  ROOT %loop_negate_fusion = f32[] fusion(%input_reduce_fusion), kind=kLoop, calls=%fused_negate
}}

"""


def _text(**edits: str) -> str:
    text = _TEMPLATE.format(B=B, S=S, D=D, V=V, R=B * S, V1=V - 1, INV=1.0 / (B * S))
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


def _sites(text: str):
    module = parse_hlo(text)
    graph = build_op_graphs(module)[0]
    return module, graph, find_lm_head_losses(graph)


def test_the_eval_loss_is_one_closed_site() -> None:
    _, graph, sites = _sites(_text())
    assert len(sites) == 1
    site = sites[0]
    assert not site.escapes
    loss = site.loss
    assert (loss.rows, loss.vocab, loss.hidden) == (B * S, V, D)
    # The sum of the rows' log-probabilities over the rows: the mean's numerator.
    assert graph.nodes[loss.log_prob_sum].name == "reduce_sum.15.1"
    assert loss.lse == loss.picked == loss.log_prob == -1
    assert graph.nodes[loss.labels].name == "labels.1"
    assert graph.nodes[loss.hidden_view.node].name == "h.1"
    assert graph.nodes[loss.embedding_view.node].name == "emb.1"
    names = {graph.nodes[v].name for v in site.members}
    assert {"gemm_fusion_dot", "reduce.6", "reduce_sum.9", "gather.3.5"} <= names
    assert "multiply.2" not in names          # the mean reads the result


@pytest.mark.parametrize("seed", (51, 52))
def test_the_sites_kernel_gives_the_modules_loss(seed: int) -> None:
    module, graph, (site,) = _sites(_text())
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((B, S, D)).astype(np.float32)
    emb = rng.standard_normal((V, D)).astype(np.float32)
    labels = rng.integers(0, V, (B, S)).astype(np.int32)
    labels[0, :2] = (-1, -V)
    args = [h, emb, labels]
    want = float(evaluate(module, args)[0])
    by_node = {v: args[graph.nodes[v].instruction.parameter_number] for v in graph.inputs}
    lowered = lower_lm_head_loss(site.loss, default_tiling(site.loss, "sm_70"))
    params = lowered.kernel.params
    ins = [np.ascontiguousarray(by_node[v], NUMPY_DTYPES[p.dtype]).reshape(-1)
           for p, v in zip(params, lowered.inputs)]
    total = np.full(1, np.inf, np.float32)
    compile_host(lowered.kernel)(*ins, total)
    assert np.isfinite(total).all()
    np.testing.assert_allclose(-float(total[0]) / (B * S), want, rtol=1e-5)


@pytest.mark.parametrize("edit", [
    # The row max reduced with an add combiner.
    {"to_apply=%region_0.1": "to_apply=%region_1.2.clone"},
    # sqrt of the sum instead of its log.
    {"log(%reduce_sum.9)": "sqrt(%reduce_sum.9)"},
    # The label's column one to the right.
    {"concatenate(%iota.5, %iota.1.3, %bitcast.1.17)": "concatenate(%iota.5, %iota.1.3, %iota.1.3)"},
    # Labels not wrapped as jax wraps them.
    {"select(%lt.1.5, %add.1.7, %bitcast.38)": "select(%lt.1.5, %bitcast.38, %bitcast.38)"},
], ids=("add-for-max", "sqrt", "iota-column", "no-wrap"))
def test_other_computations_are_no_site(edit: dict[str, str]) -> None:
    _, _, sites = _sites(_text(**edit))
    assert not sites


def test_a_gemm_with_an_epilogue_is_no_site() -> None:
    scaled = (f"%dot.2 = f32[{B * S},{V}]{{1,0}} dot(%parameter_0, %parameter_1), "
              f"lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}\n"
              f"  %half = f32[] constant(0.5)\n"
              f"  %halfb = f32[{B * S},{V}]{{1,0}} broadcast(%half), dimensions={{}}\n"
              f"  ROOT %scaled = f32[{B * S},{V}]{{1,0}} multiply(%dot.2, %halfb)")
    root = (f"ROOT %dot.2 = f32[{B * S},{V}]{{1,0}} dot(%parameter_0, %parameter_1), "
            f"lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}")
    _, _, sites = _sites(_text(**{root: scaled}))
    assert not sites


def test_logits_read_outside_make_the_site_escape() -> None:
    """The log-softmax tile also leaves the module: the site does not close."""
    text = _text(**{
        "-> f32[] {\n  %labels.1": f"-> (f32[], f32[{B},{S},{V}]) {{\n  %labels.1",
        "ROOT %loop_negate_fusion = f32[] fusion(%input_reduce_fusion), kind=kLoop, "
        "calls=%fused_negate":
        "%loop_negate_fusion = f32[] fusion(%input_reduce_fusion), kind=kLoop, "
        f"calls=%fused_negate\n  ROOT %out = (f32[], f32[{B},{S},{V}]) "
        "tuple(%loop_negate_fusion, %triton_softmax.2)"})
    _, graph, sites = _sites(text)
    assert len(sites) == 1
    assert [graph.nodes[v].name for v in sites[0].escapes] == ["sub.21"]



def _split_form(max_pad: str = "%constant_27") -> dict[str, str]:
    """XLA's form at a large vocabulary (GPT-2's 50257: 140 x 359): each row reduction split
    in two, the vocabulary padded with the reduction's identity to parts x width."""
    padded, width = V + 2, (V + 2) // 2
    return {
        f"%reduce.6 = f32[{B * S}]{{0}} reduce(%param_0.16, %constant_27), dimensions={{1}}, "
        "to_apply=%region_0.1":
        f"%padm = f32[{B * S},{padded}]{{1,0}} pad(%param_0.16, {max_pad}), padding=0_0x0_2\n"
        f"  %splitm = f32[{B * S},2,{width}]{{2,1,0}} bitcast(%padm)\n"
        f"  %partm = f32[{B * S},2]{{1,0}} reduce(%splitm, %constant_27), dimensions={{2}}, "
        "to_apply=%region_0.1\n"
        f"  %reduce.6 = f32[{B * S}]{{0}} reduce(%partm, %constant_27), dimensions={{1}}, "
        "to_apply=%region_0.1",
        f"%reduce_sum.9 = f32[{B},{S}]{{1,0}} reduce(%exp.3, %constant_23), dimensions={{2}}, "
        "to_apply=%region_1.2.clone":
        f"%pads = f32[{B},{S},{padded}]{{2,1,0}} pad(%exp.3, %constant_23), "
        "padding=0_0x0_0x0_2\n"
        f"  %splits = f32[{B},{S},2,{width}]{{3,2,1,0}} bitcast(%pads)\n"
        f"  %parts = f32[{B},{S},2]{{2,1,0}} reduce(%splits, %constant_23), dimensions={{3}}, "
        "to_apply=%region_1.2.clone\n"
        f"  %reduce_sum.9 = f32[{B},{S}]{{1,0}} reduce(%parts, %constant_23), "
        "dimensions={2}, to_apply=%region_1.2.clone"}


def test_split_row_reductions_read_as_one() -> None:
    module, graph, sites = _sites(_text(**_split_form()))
    assert len(sites) == 1 and not sites[0].escapes
    names = {graph.nodes[v].name for v in sites[0].members}
    assert {"padm", "partm", "pads", "parts"} <= names
    rng = np.random.default_rng(53)
    args = [rng.standard_normal((B, S, D)).astype(np.float32),
            rng.standard_normal((V, D)).astype(np.float32),
            rng.integers(0, V, (B, S)).astype(np.int32)]
    want = float(evaluate(module, args)[0])
    loss = sites[0].loss
    lowered = lower_lm_head_loss(loss, default_tiling(loss, "sm_70"))
    by_node = {v: args[graph.nodes[v].instruction.parameter_number] for v in graph.inputs}
    ins = [np.ascontiguousarray(by_node[v]).reshape(-1) for v in lowered.inputs]
    total = np.full(1, np.inf, np.float32)
    compile_host(lowered.kernel)(*ins, total)
    np.testing.assert_allclose(-float(total[0]) / (B * S), want, rtol=1e-5)


def test_a_split_max_padded_with_zeros_is_no_site() -> None:
    """Padding a max with 0 (not its identity) can change it: no site."""
    text = _text(**_split_form(max_pad="%constant_23")).replace(
        "  %constant_23 = f32[] constant(0)\n", "")
    inf = "  %constant_27 = f32[] constant(-inf)\n"
    text = text.replace(inf, inf + "  %constant_23 = f32[] constant(0)\n")
    _, _, sites = _sites(text)
    assert not sites
