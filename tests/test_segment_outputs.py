"""Fusions returning the segments' shape (stitch.hlo.segment_outputs): a fusion of
the XLA pass's planned module whose returned value is a reshape of its rows version
returns that version instead where every reader is a fusion; the readers take it as it
comes; values read elsewhere keep their shape. The module computes the same (reference
evaluator, fresh random inputs)."""
from __future__ import annotations

import numpy as np

from stitch.hlo import evaluate, parse_hlo, print_hlo
from stitch.hlo.segment_outputs import fusions_return_rows

COUNT, LENGTH, WIDTH = 4, 6, 3
N = COUNT * LENGTH

MODULE = f"""HloModule m
produce {{
  a0 = f32[{N},{WIDTH}] parameter(0)
  a0r = f32[{COUNT},{LENGTH},{WIDTH}] reshape(a0)
  e = f32[{COUNT},{LENGTH},{WIDTH}] exponential(a0r)
  ef = f32[{N},{WIDTH}] reshape(e)
  n = f32[{COUNT},{LENGTH},{WIDTH}] negate(a0r)
  nf = f32[{N},{WIDTH}] reshape(n)
  ROOT t = (f32[{N},{WIDTH}], f32[{N},{WIDTH}]) tuple(ef, nf)
}}
consume {{
  b0 = f32[{N},{WIDTH}] parameter(0)
  b1 = f32[{N},{WIDTH}] parameter(1)
  s = f32[{N},{WIDTH}] add(b0, b1)
  ROOT m = f32[{N},{WIDTH}] multiply(s, b0)
}}
ENTRY main {{
  p = f32[{N},{WIDTH}] parameter(0)
  f = (f32[{N},{WIDTH}], f32[{N},{WIDTH}]) fusion(p), kind=kLoop, calls=produce
  g0 = f32[{N},{WIDTH}] get-tuple-element(f), index=0
  g1 = f32[{N},{WIDTH}] get-tuple-element(f), index=1
  r = f32[{N},{WIDTH}] fusion(g0, p), kind=kLoop, calls=consume
  ROOT out = (f32[{N},{WIDTH}], f32[{N},{WIDTH}]) tuple(r, g1)
}}
"""


def _names(module):
    return {i.name for c in module.computations for i in c.instructions}


def test_a_tuple_element_read_by_fusions_is_returned_in_the_segments_shape():
    module = parse_hlo(MODULE)
    split = {N: (COUNT, LENGTH)}
    out, changed = fusions_return_rows(module, {"produce": split}, _names(module))
    assert changed == ["f"]
    entry = {i.name: i for i in out.entry.instructions}
    rows = (COUNT, LENGTH, WIDTH)
    # Element 0 (read by a fusion) comes in the segments' shape, element 1 (read by the
    # entry's root tuple) as it was; the fusion reading element 0 takes it so.
    assert tuple(entry["f"].shape.tuple_shapes[0].dims) == rows
    assert tuple(entry["f"].shape.tuple_shapes[1].dims) == (N, WIDTH)
    assert tuple(entry["g0"].shape.dims) == rows
    assert tuple(entry["g1"].shape.dims) == (N, WIDTH)
    assert tuple(entry["r"].shape.dims) == (N, WIDTH)
    produce = out.computation("produce")
    assert produce.root.operands[0] == "ef"          # the rows version, under its name
    assert tuple(produce.by_name()["ef"].shape.dims) == rows
    consume = out.computation("consume")
    assert tuple(consume.by_name()["b0"].shape.dims) == rows
    # The consumer's elementwise work runs in the segments' shape, its root reshaped back.
    assert any(tuple(i.shape.dims) == rows and i.opcode == "add"
               for i in consume.instructions)
    # The input module is not changed; the new one computes the same.
    assert tuple(module.entry.by_name()["g0"].shape.dims) == (N, WIDTH)
    x = np.random.default_rng().standard_normal((N, WIDTH)).astype(np.float32)
    want = evaluate(module, [x])
    got = evaluate(parse_hlo(print_hlo(out)), [x])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_fusion_read_outside_fusions_keeps_its_shape():
    """The consumer reads the tuple element through a non-fusion (a copy): nothing changes."""
    text = MODULE.replace("r = f32[{0},{1}] fusion(g0, p)".format(N, WIDTH),
                          "c = f32[{0},{1}] copy(g0)\n  r = f32[{0},{1}] fusion(c, p)"
                          .format(N, WIDTH))
    module = parse_hlo(text)
    out, changed = fusions_return_rows(module, {"produce": {N: (COUNT, LENGTH)}},
                                       _names(module))
    assert changed == [] and out is module
