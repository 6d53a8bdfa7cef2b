"""Sorts whose comparator is one compare of the same function of an operand's lhs and rhs
run as numpy's stable argsort (stitch.hlo.evaluator.sort.key_order): XLA's own
[64, 8732] sort modules (corpus 03878, 03906) through stitch.compile's host program, checked
against jax, and smaller sorts of many comparator forms checked against the merge sort that
handles any comparator."""
from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stitch
from stitch.hlo.evaluator import sort as sort_module
from stitch.hlo.evaluator.interpreter import Evaluator
from hlo_fixtures import DATA

CORPUS = DATA / "corpus"


@pytest.fixture
def no_merge_sort(monkeypatch):
    """The merge sort takes ~54 s on these modules: the key path must serve them."""
    def refuse(*args, **kwargs):
        raise AssertionError("the merge sort ran: the comparator was not recognised")
    monkeypatch.setattr(sort_module, "merge_sort_order", refuse)


def _jax_permutation_sort(keys):
    iota = jnp.broadcast_to(jnp.arange(keys.shape[1], dtype=jnp.int32), keys.shape)
    _, perm = jax.lax.sort((keys, iota), num_keys=1)
    desc, payload = jax.lax.sort((-perm, iota), num_keys=1)    # lt_s32 is rhs < lhs
    return -desc, payload


def test_xla_permutation_sort_module_matches_jax(no_merge_sort):
    exe = stitch.compile(CORPUS.joinpath("03878.hlo.txt").read_text(), "h100", device="cpu")
    keys = np.random.default_rng().standard_normal((64, 8732)).astype(np.float32)
    got = exe(keys)
    expected = jax.jit(_jax_permutation_sort)(keys)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_xla_stable_sort_module_matches_jax(no_merge_sort):
    exe = stitch.compile(CORPUS.joinpath("03906.hlo.txt").read_text(), "h100", device="cpu")
    rng = np.random.default_rng()
    a, b = (rng.standard_normal((64, 8732)).astype(np.float32) for _ in range(2))
    got = exe(a, b)
    expected = jax.jit(lambda x, y: jnp.sort(x, axis=1) + jnp.sort(y, axis=1))(a, b)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(expected))


SORT = """
HloModule sorts
cmp {{
  p0 = {t}[] parameter(0)
  p1 = {t}[] parameter(1)
  q0 = s32[] parameter(2)
  q1 = s32[] parameter(3)
  {body}
}}
ENTRY e {{
  k = {t}[6,300]{{1,0}} parameter(0)
  v = s32[6,300]{{1,0}} iota(), iota_dimension=1
  ROOT s = ({t}[6,300]{{1,0}}, s32[6,300]{{1,0}}) sort(k, v), dimensions={{1}}, to_apply=cmp
}}
"""

FORMS = {
    "lt": "ROOT r = pred[] compare(p0, p1), direction=LT",
    "gt": "ROOT r = pred[] compare(p0, p1), direction=GT",
    "swapped": "ROOT r = pred[] compare(p1, p0), direction=LT",
    "total": "ROOT r = pred[] compare(p0, p1), direction=LT, type=TOTALORDER",
    "total_gt": "ROOT r = pred[] compare(p0, p1), direction=GT, type=TOTALORDER",
    "abs": ("a0 = {t}[] abs(p0)\n  a1 = {t}[] abs(p1)\n"
            "  ROOT r = pred[] compare(a0, a1), direction=LT"),
    "payload": "ROOT r = pred[] compare(q0, q1), direction=GT",
    # Not a key compare: a lexicographic order (the merge sort's).
    "lexicographic": ("e = pred[] compare(p0, p1), direction=EQ\n"
                      "  l = pred[] compare(p0, p1), direction=LT\n"
                      "  m = pred[] compare(q0, q1), direction=GT\n"
                      "  ROOT r = pred[] select(e, m, l)"),
}


def _keys(t: str, rng, nan: bool) -> np.ndarray:
    if t == "s32":
        return rng.integers(-5, 5, (6, 300)).astype(np.int32)
    if t == "u32":
        return rng.integers(0, 2**32 - 1, (6, 300), dtype=np.uint32) % 7
    x = rng.integers(-4, 4, (6, 300)).astype(np.float32)   # many ties
    x[0, :3] = -0.0
    if nan:
        x[1, ::37] = np.nan
        x[2, ::41] = -np.nan
    return x


@pytest.mark.parametrize("t", ["f32", "s32", "u32"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_key_sort_equals_the_merge_sort(t, form):
    if form in ("total", "total_gt") and t != "f32":
        pytest.skip("TOTALORDER is a float compare")
    text = SORT.format(t=t, body=FORMS[form].format(t=t))
    module = stitch.parse_hlo(text)
    comp = next(c for c in module.computations if c.name == "cmp")
    recognised = sort_module.key_compare(comp)
    assert (recognised is None) == (form == "lexicographic")
    rng = np.random.default_rng()
    nan = form in ("total", "total_gt")
    keys = _keys(t, rng, nan)
    iota = np.broadcast_to(np.arange(300, dtype=np.int32), (6, 300)).copy()
    ev = Evaluator(module)
    got = sort_module.sort_order(ev, "cmp", [keys, iota])
    expected = sort_module.merge_sort_order(ev, "cmp", [keys, iota])
    np.testing.assert_array_equal(got, expected)


def test_a_plain_float_compare_meeting_a_nan_is_left_to_the_merge_sort():
    module = stitch.parse_hlo(SORT.format(t="f32", body=FORMS["lt"]))
    comp = next(c for c in module.computations if c.name == "cmp")
    keys = _keys("f32", np.random.default_rng(), nan=True)
    assert sort_module.key_order(Evaluator(module), sort_module.key_compare(comp),
                                 [keys]) is None
