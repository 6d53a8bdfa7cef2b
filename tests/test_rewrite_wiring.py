"""The module the XLA pass writes computes what XLA's module computed: every stitched custom
call is evaluated as the ops it replaced (run on its operands, in the kernel's parameter
order), the whole rewritten module by the reference evaluator, compared with the original
module on fresh random inputs. This checks the rewrite's wiring (which call element feeds
which reader, values read from an earlier kernel's call) on XLA GPU's own modules, where a
kernel's numerics are the host-run tests' job. Kernels are lowered (their parameter order
is codegen's) but not built."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from stitch.hlo import parse_hlo, print_hlo
from stitch.hlo.evaluator import custom_calls
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph_exec import GraphRunner
from stitch.xla_pass import pass_planning, entry as xla_pass
from stitch.xla_pass.hlo_rewrite import PlacedKernel
from tests.test_graph_exec import random_args
from hlo_fixtures import DATA

TARGET_PREFIX = "stitch_wiring_test."


@dataclasses.dataclass
class _FakeTarget:
    name: str


def _stitched(module_text: str, monkeypatch):
    """The module rewritten by the pass (kernels lowered, not built) and, per custom-call
    target, a function computing its outputs from its operands with the replaced ops."""
    module = parse_hlo(module_text)
    placed: list[PlacedKernel] = []
    original_place = pass_planning.PlacedKernel

    def fake_build(kernel, device, **_):
        return _FakeTarget(TARGET_PREFIX + kernel.name)

    monkeypatch.setattr(pass_planning, "build_target", fake_build)

    def recording(*args, **kwargs):
        k = original_place(*args, **kwargs)
        placed.append(k)
        return k
    monkeypatch.setattr(pass_planning, "PlacedKernel", recording)
    request = xla_pass.PassRequest(function="wiring", target="h100", device="cpu")
    report = xla_pass.stitch_module(module, request)
    return module, report, placed


def _kernel_handlers(original, report, placed):
    graphs = [g.graph for g in report.plan.graphs]
    runner = GraphRunner(original, graphs)
    handlers = {}
    for k in placed:
        graph = graphs[k.site.graph_index]

        def run(ev, inst, ops, k=k, graph=graph):
            values = dict(zip(k.inputs, ops))

            def value(nid: int):
                if nid not in values:
                    node = graph.nodes[nid]
                    # Besides its parameters a kernel reads only constants it embeds.
                    assert nid in k.site.members or node.opcode == "constant", (
                        f"{k.target} reads {node.name}, neither a parameter nor its own op")
                    for o in node.operands:
                        value(o)
                    values[nid] = runner._node(graph, node, values)
                return values[nid]
            return tuple(value(o) for o in k.outputs)
        handlers[k.target] = run
    return handlers


@pytest.mark.parametrize("model", ["transformer_train", "bert_layer_train", "dien_train",
                                   "log_softmax_xent_train", "transformer_train_bf16"])
def test_rewritten_xla_gpu_module_computes_what_xlas_did(model, monkeypatch):
    text = (DATA / model / "tiny.gpu-h100.hlo").read_text()
    module, report, placed = _stitched(text, monkeypatch)
    assert report.placed, report.skipped
    assert not [why for _, why in report.skipped if "earlier stitched kernel" in why]
    original = parse_hlo(text)
    handlers = _kernel_handlers(original, report, placed)
    monkeypatch.setattr(custom_calls, "TARGETS", {**custom_calls.TARGETS, **handlers})
    rewritten = parse_hlo(print_hlo(module, operand_shapes=True))
    calls = [i for _, i in rewritten.instructions() if i.opcode == "custom-call"
             and TARGET_PREFIX in i.attrs.get("custom_call_target", "")]
    assert len(calls) == len(report.placed)
    args = random_args(original, np.random.default_rng(7))
    want = Evaluator(original).run(original.entry, args)
    got = Evaluator(rewritten).run(rewritten.entry, args)
    want_leaves = want if isinstance(want, tuple) else (want,)
    got_leaves = got if isinstance(got, tuple) else (got,)
    assert len(got_leaves) == len(want_leaves)
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   rtol=1e-5, atol=1e-6, err_msg=f"{model}: output {i}")
