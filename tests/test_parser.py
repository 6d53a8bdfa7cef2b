"""HLO parser and printer: every fixture parses, round-trips and agrees with XLA's parser;
malformed text fails with HloParseError naming the position."""
from __future__ import annotations

import random
import re
import signal

import pytest

from stitch.hlo import HloParseError, Shape, parse_hlo, print_hlo
from tests.fixtures import all_fixture_files, fixture_id, zoo_fixture_files

FIXTURES = all_fixture_files()

SMALL = """HloModule small, entry_computation_layout={(f32[2,3]{1,0}, f32[3]{0})->f32[2,3]{1,0}}

%add_f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (x: f32[2,3], y: f32[3]) -> f32[2,3] {
  %x = f32[2,3]{1,0} parameter(0)
  %y = f32[3]{0} parameter(1)
  %b = f32[2,3]{1,0} broadcast(%y), dimensions={1}
  %c = f32[2,3]{1,0} constant({ { 1, 2, 3 }, { 4, 5, 6 } })
  %m = f32[2,3]{1,0} multiply(%x, %b), metadata={op_name="jit(f)/mul" source_file="f.py" source_line=3}
  %lt = pred[2,3]{1,0} compare(%m, %c), direction=LT
  ROOT %s = f32[2,3]{1,0} select(%lt, %m, %c)
}
"""


def test_fixtures_exist():
    assert len(zoo_fixture_files()) >= 4 * 2 * 6, "zoo fixtures are missing: run scripts/gen_fixtures.py"
    assert any(p.parent.name == "tf" for p in FIXTURES)


@pytest.mark.parametrize("path", FIXTURES, ids=fixture_id)
def test_fixture_round_trips(path):
    module = parse_hlo(path.read_text())
    assert module.computations and module.entry.instructions
    printed = print_hlo(module)
    again = parse_hlo(printed)
    assert again == module
    assert print_hlo(again) == printed
    assert not module.unknown_opcodes, module.unknown_opcodes


# XLA's enum names for opcodes whose text form is not the enum's CamelCase.
_XLA_OPCODE_ALIASES = {"exponential": "exp", "exponential-minus-one": "expm1",
                       "log-plus-one": "log1p", "sine": "sin", "cosine": "cos", "popcnt": "population-count",
                       "count-leading-zeros": "clz"}


def _normalise_opcode(ours: str) -> str:
    return _XLA_OPCODE_ALIASES.get(ours, ours).replace("-", "").lower()


@pytest.mark.parametrize("path", FIXTURES, ids=fixture_id)
def test_agrees_with_xla_parser(path):
    hlo = pytest.importorskip("jaxlib._hlo", reason="XLA's parser ships with jaxlib")
    text = path.read_text()
    xla = hlo.hlo_module_from_text(text)
    ours = parse_hlo(text)
    xla_comps = {c.name: c for c in xla.computations()}
    assert set(xla_comps) == {c.name for c in ours.computations}
    for comp in ours.computations:
        xla_insts = {i.name: i for i in xla_comps[comp.name].instructions()}
        assert set(xla_insts) == {i.name for i in comp.instructions}, comp.name
        for inst in comp.instructions:
            x = xla_insts[inst.name]
            assert _normalise_opcode(inst.opcode) == x.opcode.name[1:].lower(), inst.name
            assert [o.name for o in x.operands()] == inst.operands, inst.name


def test_small_module_structure():
    m = parse_hlo(SMALL)
    assert m.name == "small" and m.entry.name == "main"
    assert [c.name for c in m.computations] == ["add_f32", "main"]
    root = m.entry.root
    assert root.name == "s" and root.opcode == "select" and root.operands == ["lt", "m", "c"]
    b = m.entry.by_name()["b"]
    assert b.ints("dimensions") == (1,)
    assert m.entry.by_name()["c"].literal == "{ { 1, 2, 3 }, { 4, 5, 6 } }"
    assert m.entry.by_name()["m"].attrs["metadata"].startswith("{op_name=")
    assert m.computations[0].root.operands == ["a", "b"]  # typed operands drop their type
    assert m.entry.signature.params[1][1] == Shape("f32", (3,))
    assert m.attrs["entry_computation_layout"].startswith("{(f32[2,3]{1,0}")


def test_new_style_names_without_percent_and_signatures():
    text = re.sub(r"%", "", SMALL)
    text = re.sub(r"\) -> [^{]+\{", ") {", text)  # signatures stay; now also drop them:
    text = re.sub(r"(\n(?:ENTRY )?\w+) \([^)]*\) \{", r"\1 {", text)
    m = parse_hlo(text)
    assert m.entry.signature is None
    assert m.entry.root.operands == ["lt", "m", "c"]


def test_shapes_layouts_tuples_dynamic():
    text = """HloModule shapes
ENTRY e {
  p = (f32[2,3]{0,1:T(8,128)(2,1)}, s32[], (pred[4]{0}, bf16[<=8,?]{1,0})) parameter(0)
  ROOT g = f32[2,3]{0,1:T(8,128)(2,1)} get-tuple-element(p), index=0
}
"""
    m = parse_hlo(text)
    p = m.entry.parameters[0]
    assert p.shape.is_tuple and len(list(p.shape.leaves())) == 4
    tiled = p.shape.tuple_shapes[0]
    assert tiled.layout.minor_to_major == (0, 1) and tiled.layout.tiles == ((8, 128), (2, 1))
    dyn = p.shape.tuple_shapes[2].tuple_shapes[1]
    assert dyn.dims == (8, -1) and dyn.dynamic == (True, False)
    assert str(dyn) == "bf16[<=8,?]{1,0}"
    assert parse_hlo(print_hlo(m)) == m


def test_index_comments_and_tables_and_backend_config():
    text = """HloModule t, entry_computation_layout={(f32[2]{0})->f32[2]{0}}

FileNames
1 "/tmp/a.py"

StackFrames
1 {file_location_id=1 parent_frame_id=0}

ENTRY %e (a: f32[2]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  %t = (f32[2]{0}, f32[2]{0}) tuple(%a, /*index=1*/%a)
  %g = f32[2]{0} get-tuple-element(%t), index=1
  ROOT %c = f32[2]{0} custom-call(%g), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0}, "x":"a, b"}
}
"""
    m = parse_hlo(text)
    assert m.tables == [("FileNames", ['1 "/tmp/a.py"']),
                        ("StackFrames", ["1 {file_location_id=1 parent_frame_id=0}"])]
    root = m.entry.root
    assert root.string("custom_call_target") == "__cublas$gemm"
    assert root.backend_config["gemm_backend_config"]["alpha_real"] == 1
    assert m.entry.by_name()["t"].operands == ["a", "a"]
    assert parse_hlo(print_hlo(m)) == m


def test_windows_line_endings():
    path = next(p for p in FIXTURES if p.name == "tiny.gpu-h100.hlo")
    text = path.read_text()
    assert parse_hlo(text.replace("\n", "\r\n")) == parse_hlo(text)


def test_unknown_opcode_is_generic_and_flagged():
    text = SMALL.replace("ROOT %s = f32[2,3]{1,0} select(%lt, %m, %c)",
                         "ROOT %s = f32[2,3]{1,0} frobnicate(%lt, %m, %c), weird_attr={a b}")
    m = parse_hlo(text)
    assert m.unknown_opcodes == [("s", "frobnicate")]
    assert m.entry.root.attrs == {"weird_attr": "{a b}"}
    assert parse_hlo(print_hlo(m)) == m


def _error(text: str) -> HloParseError:
    with pytest.raises(HloParseError) as info:
        parse_hlo(text)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.line >= 1 and err.column >= 1
    return err


def _line_of(text: str, needle: str) -> int:
    return text[:text.index(needle)].count("\n") + 1


@pytest.mark.parametrize("bad, needle, words", [
    # bad shape: a non-numeric dimension
    ("%b = f32[2,x]{1,0} broadcast(%y)", "x]{1,0} broadcast", "dimension"),
    # unknown element type
    ("%b = f33[2,3]{1,0} broadcast(%y)", "f33", "element type"),
    # layout that is not a permutation
    ("%b = f32[2,3]{1,1} broadcast(%y)", "{1,1}", "permutation"),
    # unknown attribute value
    ("%lt = pred[2,3]{1,0} compare(%m, %c), direction=LESS", "LESS", "direction"),
    # missing operand (arity) and undefined operand
    ("%m = f32[2,3]{1,0} multiply(%x), metadata={op_name=\"jit(f)/mul\" source_file=\"f.py\" source_line=3}",
     "multiply(", "operand"),
    ("%m = f32[2,3]{1,0} multiply(%x, %nope)", "%nope", "'nope'"),
    # literal with the wrong number of elements
    ("%c = f32[2,3]{1,0} constant({ { 1, 2, 3 }, { 4, 5 } })", "{ { 1, 2, 3 }", "elements"),
    # bad dimensions list
    ("%b = f32[2,3]{1,0} broadcast(%y), dimensions={one}", "{one}", "integers"),
])
def test_malformed_inputs_name_the_position(bad, needle, words):
    original_line = next(line.strip() for line in SMALL.splitlines()
                         if line.strip().startswith(bad.split(" =")[0] + " ="))
    text = SMALL.replace(original_line, bad)
    assert text != SMALL
    err = _error(text)
    assert err.line == _line_of(text, needle), str(err)
    assert words in str(err), str(err)
    line_text = text.splitlines()[err.line - 1]
    assert err.column - 1 <= len(line_text)


def test_truncated_file():
    cut = SMALL[: SMALL.index("ROOT %s")]
    err = _error(cut)
    assert "end of input" in str(err)
    assert err.line == cut.count("\n") + 1


def test_other_structural_errors():
    assert "HloModule" in str(_error("Module x\n"))
    assert "defined twice" in str(_error(SMALL.replace("%b = f32[2,3]{1,0} broadcast", "%x = f32[2,3]{1,0} broadcast")
                                         .replace("multiply(%x, %b)", "multiply(%x, %x)")))
    assert "unknown computation" in str(_error(SMALL.replace("ROOT %s = f32[2,3]{1,0} select(%lt, %m, %c)",
                                                             "ROOT %s = f32[] reduce(%m, %c), dimensions={0,1}, to_apply=%nowhere")))
    cyc = SMALL.replace("multiply(%x, %b)", "multiply(%x, %s)")
    assert "cycle" in str(_error(cyc))
    assert "unterminated" in str(_error(SMALL.replace('op_name="jit(f)/mul"', 'op_name="jit(f)/mul')))


def test_parse_rejects_non_text():
    with pytest.raises(TypeError):
        parse_hlo(b"HloModule x")


def _mutations(text: str, rng: random.Random, count: int):
    alphabet = "{}[](),=%:.\"x0123456789 \nabcf-_/*<"
    tokens = re.findall(r"\w+|\s+|.", text)
    for _ in range(count):
        kind = rng.randrange(6)
        if kind == 0:  # truncate
            yield text[: rng.randrange(len(text))]
        elif kind == 1:  # delete a span
            i = rng.randrange(len(text))
            yield text[:i] + text[i + rng.randint(1, 8):]
        elif kind == 2:  # insert noise
            i = rng.randrange(len(text))
            yield text[:i] + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) + text[i:]
        elif kind == 3:  # swap two tokens
            t = list(tokens)
            a, b = rng.randrange(len(t)), rng.randrange(len(t))
            t[a], t[b] = t[b], t[a]
            yield "".join(t)
        elif kind == 4:  # duplicate a line
            lines = text.splitlines(keepends=True)
            i = rng.randrange(len(lines))
            yield "".join(lines[:i + 1] + [lines[i]] + lines[i + 1:])
        else:  # replace a token with another token from the file
            t = list(tokens)
            t[rng.randrange(len(t))] = rng.choice(tokens)
            yield "".join(t)


class _Hang(Exception):
    pass


def test_fuzz_mutated_real_hlo_only_raises_parse_errors():
    sources = [p for p in zoo_fixture_files() if "tiny" in p.name][:12] or FIXTURES[:6]
    rng = random.Random(1234)

    def on_alarm(signum, frame):
        raise _Hang()

    old = signal.signal(signal.SIGALRM, on_alarm)
    outcomes = {"parsed": 0, "error": 0}
    try:
        for path in sources:
            text = path.read_text()
            for mutated in _mutations(text, rng, 60):
                signal.alarm(10)  # a hang guard, not a speed assertion
                try:
                    parse_hlo(mutated)
                    outcomes["parsed"] += 1
                except HloParseError as exc:
                    assert exc.line >= 0 and str(exc)
                    outcomes["error"] += 1
                except _Hang:
                    pytest.fail(f"parser hung on a mutation of {path.name}")
                finally:
                    signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert outcomes["error"] > 0 and outcomes["parsed"] + outcomes["error"] == 60 * len(sources)


SHAPES_ALIKE = """HloModule shapes

ENTRY %main (p: f32[8,128], q: f32[8,128]) -> (f32[8,128], f32[8,128], f32[<=8,128], f32[8,128]) {
  %p = f32[8,128]{1,0} parameter(0)
  %q = f32[8,128]{1,0:T(8,128)} parameter(1)
  %a = f32[8,128]{1,0} add(f32[8,128]{1,0} %p, f32[8,128]{1,0} %p)
  %t = f32[8,128]{0,1} transpose(%a), dimensions={1,0}
  %d = f32[<=8,128]{1,0} copy(%p)
  %n = f32[8,128] negate(%p)
  ROOT %r = (f32[8,128]{1,0}, f32[8,128]{1,0:T(8,128)}, f32[<=8,128]{1,0}, f32[8,128]{0,1}) tuple(%a, %q, %d, %t)
}
"""


def test_alike_shapes_are_parsed_once_and_tiles_layouts_and_bounds_kept_apart():
    """Dense shapes printed alike are one object per module (parsed once: immutable);
    a tiled layout, a bounded dim, another layout or none starting with the same text
    are parsed as what they are."""
    comp = parse_hlo(SHAPES_ALIKE).entry
    shapes = {i.name: i.shape for i in comp.instructions}
    assert shapes["p"] is shapes["a"]
    assert shapes["q"].layout.tail == "T(8,128)" and shapes["q"] != shapes["p"]
    assert shapes["d"].dynamic == (True, False) and shapes["d"] != shapes["p"]
    assert shapes["t"].layout.minor_to_major == (0, 1)
    assert shapes["n"].layout is None
    tuple_shapes = shapes["r"].tuple_shapes
    assert tuple_shapes[0] is shapes["p"] and tuple_shapes[1] == shapes["q"]
    assert tuple_shapes[2] == shapes["d"] and tuple_shapes[3] == shapes["t"]
    assert parse_hlo(print_hlo(parse_hlo(SHAPES_ALIKE))) == parse_hlo(SHAPES_ALIKE)
