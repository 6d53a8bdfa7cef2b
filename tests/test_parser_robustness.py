"""Hostile HLO text: deep nesting, call cycles and chains, huge strings and constants give an
HloParseError (with a position) or just work: never a RecursionError, never gigabytes."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from stitch.hlo import HloParseError, evaluate, parse_hlo
from stitch.hlo.parser import MAX_CALL_DEPTH


def _parses_or_parse_error(text: str) -> HloParseError | None:
    try:
        parse_hlo(text)
    except HloParseError as exc:
        assert exc.line >= 1 and exc.column >= 1
        return exc
    return None


def test_5000_deep_tuple_shape_is_a_parse_error():
    shape = "(" * 5000 + "f32[]" + ")" * 5000
    exc = _parses_or_parse_error(f"HloModule m\nENTRY e {{\n  ROOT p = {shape} parameter(0)\n}}\n")
    assert exc is not None and "nesting deeper" in exc.message


@pytest.mark.parametrize("where", ["shape", "operand", "attribute", "literal", "nested"])
def test_100k_nested_parentheses_never_recurse(where):
    deep = "(" * 100_000
    body = {
        "shape": f"ROOT p = {deep}f32[] parameter(0)",
        "operand": f"p = f32[] parameter(0)\n  ROOT a = f32[] add({deep}",
        "attribute": f"ROOT p = f32[] parameter(0), foo={deep}",
        "literal": f"ROOT c = f32[] constant({deep})",
        "nested": "ROOT n = f32[] negate(" * 3000 + "f32[] parameter(0)" + ")" * 3000,
    }[where]
    assert _parses_or_parse_error(f"HloModule m\nENTRY e {{\n  {body}\n}}\n") is not None


def _chain(depth: int) -> str:
    comps = ["c0 {\n  p = f32[] parameter(0)\n  ROOT n = f32[] negate(p)\n}"]
    for i in range(1, depth):
        comps.append(f"c{i} {{\n  p = f32[] parameter(0)\n"
                     f"  ROOT r = f32[] call(p), to_apply=c{i - 1}\n}}")
    comps.append(f"ENTRY e {{\n  p = f32[] parameter(0)\n"
                 f"  ROOT r = f32[] call(p), to_apply=c{depth - 1}\n}}")
    return "HloModule chain\n" + "\n".join(comps) + "\n"


def test_3000_deep_call_chain_is_a_parse_error():
    exc = _parses_or_parse_error(_chain(3000))
    assert exc is not None and "call chain" in exc.message


def test_call_chain_at_the_limit_evaluates_plans_and_compiles():
    module = parse_hlo(_chain(MAX_CALL_DEPTH - 1))
    x = np.array(np.random.default_rng(0).standard_normal(), np.float32)
    want = x if (MAX_CALL_DEPTH - 1) % 2 == 0 else -x
    np.testing.assert_array_equal(evaluate(module, [x])[0], want)
    import stitch
    exe = stitch.compile(module, "h100", "cpu", cache=False, poison_outputs=True)
    np.testing.assert_array_equal(exe(x)[0], want)


@pytest.mark.parametrize("text", [
    # A -> B -> A
    "HloModule m\na {\n  p = f32[] parameter(0)\n  ROOT r = f32[] call(p), to_apply=b\n}\n"
    "b {\n  p = f32[] parameter(0)\n  ROOT r = f32[] call(p), to_apply=a\n}\n"
    "ENTRY e {\n  p = f32[] parameter(0)\n  ROOT r = f32[] call(p), to_apply=a\n}\n",
    # ENTRY calling itself
    "HloModule m\nENTRY e {\n  p = f32[] parameter(0)\n  ROOT r = f32[] call(p), to_apply=e\n}\n",
    # a while body that is its own condition's caller
    "HloModule m\nc {\n  p = f32[] parameter(0)\n  ROOT r = pred[] call(p), to_apply=c\n}\n"
    "ENTRY e {\n  p = f32[] parameter(0)\n  ROOT w = f32[] while(p), condition=c, body=c\n}\n",
])
def test_call_cycles_are_parse_errors(text):
    exc = _parses_or_parse_error(text)
    assert exc is not None and "call cycle" in exc.message and exc.line > 1


def _peak_mb(code: str) -> float:
    """Peak memory (MB) the snippet adds to a fresh interpreter that has built its input."""
    script = textwrap.dedent(f"""
        import resource, sys
        from stitch.hlo import parse_hlo
        {code.strip()}
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def test_10mb_quoted_string_costs_little_memory():
    added = _peak_mb("""
        text = ('HloModule m\\nENTRY e {\\n  ROOT p = f32[] parameter(0), metadata={op_name="'
                + "x" * 10_000_000 + '"}\\n}\\n')
        def run():
            parse_hlo(text)
    """)
    assert added < 100, f"parsing a 10 MB string took {added:.0f} MB"


def test_3m_element_constant_is_fast_and_small():
    added = _peak_mb("""
        import time
        n = 3_000_000
        text = 'HloModule m\\nENTRY e {\\n  ROOT c = f32[%d] constant({%s})\\n}\\n' % (
            n, ", ".join(["1.25", "-2e-3", "inf", "7"] * (n // 4)))
        def run():
            start = time.perf_counter()
            module = parse_hlo(text)
            seconds = time.perf_counter() - start
            assert seconds < 20, seconds
            from stitch.hlo import evaluate
            (value,) = evaluate(module, [])
            assert value.shape == (n,) and value[2] == float("inf") and value[1] == -2e-3
    """)
    assert added < 200, f"a 3M-element constant took {added:.0f} MB"


@pytest.mark.parametrize("etype, values, dtype", [
    ("u64", [18446744073709551615, 3, 9223372036854775808], np.uint64),
    ("s64", [-9223372036854775808, 9223372036854775807, -5], np.int64),
    ("s32", [-2147483648, 2147483647, 0], np.int32),
    ("f32", [3.4028234663852886e38, -1e-45, 0.1], np.float32),
])
def test_literal_fast_path_keeps_exact_values(etype, values, dtype):
    text = (f"HloModule m\nENTRY e {{\n  ROOT c = {etype}[3] constant({{"
            f"{', '.join(repr(v) for v in values)}}})\n}}\n")
    (got,) = evaluate(parse_hlo(text), [])
    want = np.array(values, np.float64 if dtype == np.float32 else dtype).astype(dtype)
    np.testing.assert_array_equal(got, want)
