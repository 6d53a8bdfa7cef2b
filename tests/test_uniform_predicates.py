"""Predicates proved all true or all false from how they are built
(``scatter_forms.uniform_predicate``), kept per structure across graphs: each verdict equals
evaluating the predicate, and two predicates that differ in anything that decides it (a
constant, a direction, a shape) do not share one."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import parse_hlo, scatter_forms
from stitch.hlo.graph import build_op_graphs

DIRECTIONS = ("LT", "LE", "GT", "GE", "EQ", "NE")


def _module(n: int, bound: int, direction: str, layers: int) -> str:
    body = []
    roots = []
    for i in range(layers):
        body += [f"  %iota.{i} = s32[{n},4]{{1,0}} iota(), iota_dimension=0",
                 f"  %bound.{i} = s32[] constant({bound})",
                 f"  %bb.{i} = s32[{n},4]{{1,0}} broadcast(%bound.{i}), dimensions={{}}",
                 f"  %p.{i} = pred[{n},4]{{1,0}} compare(%iota.{i}, %bb.{i}), "
                 f"direction={direction}",
                 f"  %s.{i} = f32[{n},4]{{1,0}} select(%p.{i}, %a, %b)"]
        roots.append(f"%s.{i}")
    shapes = ", ".join([f"f32[{n},4]{{1,0}}"] * layers)
    return "\n".join([
        "HloModule uniform", "",
        f"ENTRY %main (a: f32[{n},4], b: f32[{n},4]) -> ({shapes}) {{",
        f"  %a = f32[{n},4]{{1,0}} parameter(0)",
        f"  %b = f32[{n},4]{{1,0}} parameter(1)",
        *body,
        f"  ROOT %t = ({shapes}) tuple({', '.join(roots)})", "}"])


@pytest.mark.parametrize("seed", range(4))
def test_verdicts_equal_the_predicates_and_are_kept_per_structure(seed, monkeypatch) -> None:
    rng = np.random.default_rng()
    computed = []
    real = scatter_forms._known_values

    def counting(graph, v):
        computed.append(v)
        return real(graph, v)
    monkeypatch.setattr(scatter_forms, "_known_values", counting)
    n = int(rng.integers(2, 40))
    for bound in (int(rng.integers(-3, n + 3)), 0, n, n - 1):
        direction = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
        text = _module(n, bound, direction, layers=3)
        graph = build_op_graphs(parse_hlo(text))[0]
        preds = [node.id for node in graph.nodes if node.opcode == "compare"]
        before = len(computed)
        verdicts = [scatter_forms.uniform_predicate(graph, v) for v in preds]
        # The three layers' predicates are one structure: computed at most once.
        assert len(computed) - before <= 1
        iota = np.arange(n)
        want_values = {"LT": iota < bound, "LE": iota <= bound, "GT": iota > bound,
                       "GE": iota >= bound, "EQ": iota == bound, "NE": iota != bound}[direction]
        want = True if want_values.all() else False if not want_values.any() else None
        assert verdicts == [want] * 3, (n, bound, direction)
