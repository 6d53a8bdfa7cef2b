"""stitch.xla_pass.hlo_rewrite.replace_kernels places a computation's kernels in one pass
with one cycle check: its work per kernel does not grow with the module (checking each kernel
against the whole computation took 30 s for a 48-layer GPT-2 training step's 391 kernels), a
kernel whose placement closes a cycle is still refused with the per-kernel check's reason,
and the module then holds exactly the kernels that fit."""
from __future__ import annotations

import sys
from typing import Callable

import pytest

pytest.importorskip("jaxlib")

from stitch.hlo import parse_hlo, print_hlo  # noqa: E402
from stitch.hlo.graph import build_op_graphs  # noqa: E402
from stitch.xla_pass import hlo_rewrite  # noqa: E402
from stitch.xla_pass.hlo_rewrite import (ComputationView, KernelSite, PlacedKernel,  # noqa: E402
                                            replace_kernels)
from stitch.xla_pass.pass_registration import to_proto  # noqa: E402

A = "f32[8,16]"


def layered_module(layers: int) -> str:
    """``layers`` copies of one layer: a -> b -> c(b, a) -> m (two outputs, read through
    gtes) -> x(g0, g1), the next layer's input."""
    bodies, entry = [], [f"  x0 = {A} parameter(0)"]
    for i in range(layers):
        bodies.append(f"""fa{i} {{
  pa{i} = {A} parameter(0)
  ROOT ea{i} = {A} exponential(pa{i})
}}
fb{i} {{
  pb{i} = {A} parameter(0)
  ROOT nb{i} = {A} negate(pb{i})
}}
fc{i} {{
  pc{i}0 = {A} parameter(0)
  pc{i}1 = {A} parameter(1)
  ROOT ac{i} = {A} add(pc{i}0, pc{i}1)
}}
fm{i} {{
  pm{i} = {A} parameter(0)
  em{i} = {A} exponential(pm{i})
  nm{i} = {A} negate(pm{i})
  ROOT tm{i} = ({A}, {A}) tuple(em{i}, nm{i})
}}
fd{i} {{
  pd{i}0 = {A} parameter(0)
  pd{i}1 = {A} parameter(1)
  ROOT md{i} = {A} multiply(pd{i}0, pd{i}1)
}}""")
        entry += [f"  a{i} = {A} fusion(x{i}), kind=kLoop, calls=fa{i}",
                  f"  b{i} = {A} fusion(a{i}), kind=kLoop, calls=fb{i}",
                  f"  c{i} = {A} fusion(b{i}, a{i}), kind=kLoop, calls=fc{i}",
                  f"  m{i} = ({A}, {A}) fusion(c{i}), kind=kLoop, calls=fm{i}",
                  f"  g{i}0 = {A} get-tuple-element(m{i}), index=0",
                  f"  g{i}1 = {A} get-tuple-element(m{i}), index=1",
                  f"  x{i + 1} = {A} fusion(g{i}0, g{i}1), kind=kLoop, calls=fd{i}"]
    entry.append(f"  ROOT r = ({A}, {A}) tuple(x{layers}, c0)")
    return "HloModule layers\n" + "\n".join(bodies) + "\nENTRY e {\n" + "\n".join(entry) + "\n}\n"


def _kernel(node: dict[str, int], name: str, members: list[str], tops: tuple[str, ...],
            inputs: list[str], outputs: list[str]) -> PlacedKernel:
    return PlacedKernel(KernelSite(name, 0, frozenset(node[m] for m in members), tops),
                        [node[i] for i in inputs], [node[o] for o in outputs],
                        f"stitch_test_{name}")


def layer_kernels(node: dict[str, int], layers: int) -> list[PlacedKernel]:
    """Two kernels a layer: a+b, and m with its gtes' reader x (even layers: the gtes go
    with them) or m alone (odd layers: its gtes are retargeted to the call)."""
    kernels = []
    for i in range(layers):
        source = "x0" if i == 0 else f"md{i - 1}"
        kernels.append(_kernel(node, f"ab{i}", [f"ea{i}", f"nb{i}"], (f"a{i}", f"b{i}"),
                               [source], [f"ea{i}", f"nb{i}"]))
        if i % 2 == 0:
            kernels.append(_kernel(node, f"mx{i}", [f"em{i}", f"nm{i}", f"md{i}"],
                                   (f"m{i}", f"x{i + 1}"), [f"ac{i}"], [f"md{i}"]))
        else:
            kernels.append(_kernel(node, f"m{i}", [f"em{i}", f"nm{i}"], (f"m{i}",),
                                   [f"ac{i}"], [f"em{i}", f"nm{i}"]))
    return kernels


def _setup(text: str):
    module = parse_hlo(text)
    graph = build_op_graphs(module)[0]
    view = ComputationView(module, graph)
    return module, graph, view, {n.instruction.name: n.id for n in graph.nodes}


def _traced_lines(run: Callable[[], object]) -> int:
    """Python lines executed by ``run()`` (every frame it enters; loops count per pass):
    work, counted the same on any machine."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(previous)
    return count


def _placement_work(layers: int, monkeypatch) -> tuple[float, int]:
    """(lines executed per kernel, cycle checks) placing ``layer_kernels``."""
    module, graph, view, node = _setup(layered_module(layers))
    kernels = layer_kernels(node, layers)
    sorts = []
    real = hlo_rewrite._topological

    def counting(*args, **kwargs):
        sorts.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(hlo_rewrite, "_topological", counting)
    reports = []
    lines = _traced_lines(lambda: reports.append(replace_kernels(module, [graph], kernels,
                                                                 {0: view})))
    assert len(reports[0].placed) == len(kernels), reports[0].skipped
    return lines / len(kernels), len(sorts)


def test_placement_work_per_kernel_does_not_grow_with_the_module(monkeypatch):
    small, small_sorts = _placement_work(4, monkeypatch)
    large, large_sorts = _placement_work(32, monkeypatch)
    # One topological sort for all kernels (two where a kernel drops an operand unread),
    # not one per kernel.
    assert small_sorts <= 2 and large_sorts <= 2, (small_sorts, large_sorts)
    # 8x the layers and kernels: checking each kernel against the whole computation did
    # about 6x the work per kernel; placing them in one pass does the same.
    assert large <= 1.5 * small, (small, large)


def test_layered_kernels_are_all_placed_and_xla_reads_the_module():
    module, graph, view, node = _setup(layered_module(3))
    report = replace_kernels(module, [graph], layer_kernels(node, 3), {0: view})
    assert report.placed == ["ab0", "mx0", "ab1", "m1", "ab2", "mx2"], report.skipped
    to_proto(print_hlo(module, operand_shapes=True))
    by_name = {i.name: i for i in module.entry.instructions}
    # Odd layers: m's gtes now read the call; even layers: they went with x.
    assert by_name["g10"].operands == ["stitch.m1"] and "g00" not in by_name


def _bad_kernel(node: dict[str, int]) -> PlacedKernel:
    """Layer 1's a and c without b between them: b reads a and c reads b, so the call would
    read b, which reads the call's a."""
    return _kernel(node, "bad", ["ea1", "ac1"], ("a1", "c1"), ["md0", "nb1"], ["ea1", "ac1"])


CYCLE_REASON = "placing it would make a cycle through a1, a2, b1, b2"


@pytest.mark.parametrize("at", [0, 2, 4])     # first, between, last
def test_a_kernel_closing_a_cycle_is_refused_and_the_others_placed_as_alone(at):
    module, graph, view, node = _setup(layered_module(3))
    kernels = [k for k in layer_kernels(node, 3) if k.site.name not in ("ab1", "m1")]
    kernels.insert(at, _bad_kernel(node))
    report = replace_kernels(module, [graph], kernels, {0: view})
    assert report.skipped == [("bad", CYCLE_REASON)]
    assert report.placed == [k.site.name for k in kernels if k.site.name != "bad"]
    assert kernels[at].site.tops == ("a1", "c1")            # its site as it came
    # The module is the one the other kernels make alone: the refused kernel left nothing.
    alone, alone_graph, alone_view, alone_node = _setup(layered_module(3))
    others = [k for k in layer_kernels(alone_node, 3) if k.site.name not in ("ab1", "m1")]
    replace_kernels(alone, [alone_graph], others, {0: alone_view})
    assert print_hlo(module) == print_hlo(alone)


def test_two_kernels_closing_cycles_are_both_refused():
    module, graph, view, node = _setup(layered_module(3))
    kernels = [k for k in layer_kernels(node, 3) if k.site.name not in ("ab1", "m1", "ab2")]
    second = _kernel(node, "bad2", ["ea2", "ac2"], ("a2", "c2"), ["md1", "nb2"],
                     ["ea2", "ac2"])
    kernels[1:1] = [_bad_kernel(node)]
    kernels.append(second)
    report = replace_kernels(module, [graph], kernels, {0: view})
    assert [name for name, _ in report.skipped] == ["bad", "bad2"]
    assert all(why.startswith("placing it would make a cycle through ")
               for _, why in report.skipped)
    assert report.placed == ["ab0", "mx0", "mx2"]
    names = {i.name for i in module.entry.instructions}
    assert {"a1", "b1", "c1", "a2", "b2", "c2"} <= names
    assert not names & {"stitch.bad", "stitch.bad2"}


DROPPED_OPERAND = f"""HloModule m
fa {{
  pa = {A} parameter(0)
  ROOT ea = {A} exponential(pa)
}}
fy {{
  py = {A} parameter(0)
  ROOT ny = {A} negate(py)
}}
fu {{
  pu = {A} parameter(0)
  ROOT tu = {A} tanh(pu)
}}
fc {{
  pc0 = {A} parameter(0)
  pc1 = {A} parameter(1)
  ROOT ac = {A} add(pc0, pc1)
}}
ENTRY e {{
  x = {A} parameter(0)
  a = {A} fusion(x), kind=kLoop, calls=fa
  y = {A} fusion(a), kind=kLoop, calls=fy
  u = {A} fusion(y), kind=kLoop, calls=fu
  c = {A} fusion(a, u), kind=kLoop, calls=fc
  ROOT r = ({A}, {A}) tuple(c, y)
}}"""


def test_an_operand_the_kernel_drops_unread_does_not_refuse_it(monkeypatch):
    # The kernel replaces u without reading y, u's operand (as a segment kernel drops
    # XLA's index fusions). Kept as an edge into the call, y -> u closes a cycle through the
    # call's a -> y; the module itself has none: the kernel is placed, as checking it alone
    # placed it (the one-pass check finds the cycle and checks that kernel again without).
    module, graph, view, node = _setup(DROPPED_OPERAND)
    kernel = _kernel(node, "k", ["ea", "ac"], ("a", "u", "c"), ["x"], ["ea", "ac"])
    sorts = []
    real = hlo_rewrite._topological
    monkeypatch.setattr(hlo_rewrite, "_topological",
                        lambda *a, **kw: (sorts.append(1), real(*a, **kw))[1])
    report = replace_kernels(module, [graph], [kernel], {0: view})
    assert report.placed == ["k"], report.skipped
    assert len(sorts) > 2                       # the cycle was found and checked again
    assert [i.name for i in module.entry.instructions] == ["x", "stitch.k", "a", "y", "c",
                                                           "r"]
