"""The parser reads what XLA's parser reads: modules from XLA's own tests (hlo_fixtures/data/corpus,
see its README) parse, their inferred shapes are XLA's, and print -> parse round-trips."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from stitch.hlo import HloParseError, evaluate, parse_hlo, print_hlo
from hlo_fixtures import DATA

CORPUS = DATA / "corpus"
MODULES = sorted(CORPUS.glob("*.hlo.txt"))


def _xla_module_text(text: str) -> str:
    from jaxlib import _hlo
    return _hlo.hlo_module_from_text(text).to_string()


def _shapes(module) -> dict[tuple[str, str], str]:
    return {(comp.name, inst.name): str(inst.shape.without_layout())
            for comp, inst in module.instructions()}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_corpus_module_parses_like_xla(path):
    text = path.read_text()
    ours = parse_hlo(text)
    theirs = parse_hlo(_xla_module_text(text))  # XLA prints every shape it inferred
    mine, xla = _shapes(ours), _shapes(theirs)
    shared = set(mine) & set(xla)
    assert shared, "no instruction names in common"
    assert {n: mine[n] for n in shared} == {n: xla[n] for n in shared}
    assert str(ours.entry.root.shape.without_layout()) == \
        str(theirs.entry.root.shape.without_layout())
    printed = print_hlo(ours)
    assert print_hlo(parse_hlo(printed)) == printed


def test_no_header_and_nested_operand_instructions():
    module = parse_hlo("ENTRY e {\n  ROOT r = f16[10,10] convert(f32[10,10] "
                       "reshape(f32[100] parameter(0)))\n}\n")
    entry = module.entry
    assert [i.opcode for i in entry.instructions] == ["parameter", "reshape", "convert"]
    assert entry.root.operands == [entry.instructions[1].name]
    x = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    (out,) = evaluate(module, [x])
    np.testing.assert_array_equal(out, x.reshape(10, 10).astype(np.float16))


def test_inferred_shapes_per_opcode():
    text = """
    add { a = f32[] parameter(0)  b = f32[] parameter(1)  ROOT s = add(a, b) }
    ENTRY e {
      p = f32[4,6] parameter(0)
      q = f32[6,3] parameter(1)
      t = transpose(p), dimensions={1,0}
      d = dot(p, q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      z = f32[] constant(0)
      pd = pad(p, z), padding=1_2x0_1_1
      r = reduce(p, z), dimensions={1}, to_apply=add
      w = reduce-window(p, z), window={size=2x3 stride=2x1 pad=0_0x1_1}, to_apply=add
      c = compare(p, p), direction=LT
      cat = concatenate(p, p), dimensions={0}
      tu = tuple(t, d)
      g = get-tuple-element(tu), index=1
      ROOT out = tuple(pd, r, w, c, cat, g)
    }
    """
    shapes = {n: s for (_, n), s in _shapes(parse_hlo(text)).items()}
    assert shapes["t"] == "f32[6,4]" and shapes["d"] == "f32[4,3]" and shapes["g"] == "f32[4,3]"
    assert shapes["pd"] == "f32[7,12]" and shapes["r"] == "f32[4]" and shapes["w"] == "f32[2,6]"
    assert shapes["c"] == "pred[4,6]" and shapes["cat"] == "f32[8,6]" and shapes["s"] == "f32[]"
    xla = {n: s for (_, n), s in _shapes(parse_hlo(_xla_module_text(text))).items()}
    assert shapes == xla  # XLA infers the same


def test_shape_that_xla_cannot_infer_is_a_clear_error():
    with pytest.raises(HloParseError, match="broadcast 'b' has no result shape"):
        parse_hlo("ENTRY e {\n  p = f32[] parameter(0)\n  ROOT b = broadcast(p), dimensions={}\n}\n")
    with pytest.raises(HloParseError, match="parameter 'p' needs its shape"):
        parse_hlo("ENTRY e {\n  ROOT p = parameter(0)\n}\n")


def test_scalar_literal_fills_a_non_scalar_constant():
    module = parse_hlo(CORPUS.joinpath("08750.hlo.txt").read_text())
    x = np.random.default_rng(1).standard_normal((2, 2)).astype(np.float32)
    np.testing.assert_array_equal(evaluate(module, [x])[0], x)
    (seven,) = evaluate(parse_hlo("ENTRY e {\n  ROOT c = s32[2,3] constant(7)\n}\n"), [])
    np.testing.assert_array_equal(seven, np.full((2, 3), 7, np.int32))


def test_inline_computation_attribute():
    module = parse_hlo(CORPUS.joinpath("04736.hlo.txt").read_text())
    call = module.entry.root
    callee = module.computation(call.attrs["to_apply"])
    assert callee.root.opcode == "tuple" and str(call.shape) == "(s32[])"
    a, b = np.int32(5), np.int32(-9)
    assert evaluate(module, [np.array(a), np.array(b)])[0] == a


def test_multiline_string_comment_after_attribute_and_nested_slice_sizes():
    for name in ("03500.hlo.txt", "04730.hlo.txt", "02546.hlo.txt"):
        parse_hlo(CORPUS.joinpath(name).read_text())
    module = parse_hlo(CORPUS.joinpath("04730.hlo.txt").read_text())
    gte = module.entry.by_name()["gte.0"]
    assert gte.attrs["index"] == "0"  # the trailing comment is not part of the value


def test_module_name_with_colon_and_no_entry_keyword():
    module = parse_hlo(CORPUS.joinpath("03332.hlo.txt").read_text())
    assert module.name == "no_entry" and module.entry.name == "c2"


def test_literal_with_index_comments_and_empty_dims():
    module = parse_hlo(CORPUS.joinpath("03080.hlo.txt").read_text())
    assert evaluate(module, [])[0].shape == (2, 0, 4, 3)
    module = parse_hlo(CORPUS.joinpath("01666.hlo.txt").read_text())
    assert module.entry.by_name()["constant.1"].shape.dims == (3, 3, 1, 12)
