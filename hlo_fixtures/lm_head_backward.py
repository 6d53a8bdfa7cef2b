"""The LM head + cross-entropy backward as two GEMM chains (dH: tokens walk the vocabulary,
dE: vocabulary rows walk the tokens), HLO templates over sizes and types: what the chain
recognizer and the chain kernels are checked on, and the LM-head bench prices."""
from __future__ import annotations

# The tokens, vocabulary and hidden sizes the tests use: no tile divides them.
N, V, D = 40, 300, 24

def _form(by_vocabulary: bool) -> str:
    """The template of dH (score rows are tokens: [n, v]) or dE (score rows are vocabulary
    entries: [v, n]); the token axis of the scores is 0 for dH and 1 for dE."""
    rows, cols = ("{v}", "{n}") if by_vocabulary else ("{n}", "{v}")
    name, first, other, token_axis = ("de", "emb, h", "h", 1) if by_vocabulary else \
        ("dh", "h, emb", "emb", 0)
    iota_name, iota_axis = ("row", 0) if by_vocabulary else ("col", 1)
    shape = f"[{rows},{cols}]"
    second_dims = "lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}"
    return f"""HloModule {name}
ENTRY e {{{{
  h = {{t}}[{{n}},{{d}}] parameter(0)
  emb = {{t}}[{{v}},{{d}}] parameter(1)
  lse = f32[{{n}}] parameter(2)
  label = s32[{{n}}] parameter(3)
  g = f32[{{n}}] parameter(4)
  s0 = {{t}}{shape} dot({first}), lhs_contracting_dims={{{{1}}}}, rhs_contracting_dims={{{{1}}}}
  s = f32{shape} convert(s0)
  lseb = f32{shape} broadcast(lse), dimensions={{{{{token_axis}}}}}
  x = f32{shape} subtract(s, lseb)
  p = f32{shape} exponential(x)
  {iota_name} = s32{shape} iota(), iota_dimension={iota_axis}
  labelb = s32{shape} broadcast(label), dimensions={{{{{token_axis}}}}}
  hit = pred{shape} compare({iota_name}, labelb), direction=EQ
  one = f32[] constant(1)
  zero = f32[] constant(0)
  oneb = f32{shape} broadcast(one), dimensions={{{{}}}}
  zerob = f32{shape} broadcast(zero), dimensions={{{{}}}}
  onehot = f32{shape} select(hit, oneb, zerob)
  d = f32{shape} subtract(p, onehot)
  gb = f32{shape} broadcast(g), dimensions={{{{{token_axis}}}}}
  dl = f32{shape} multiply(d, gb)
  dlt = {{t}}{shape} convert(dl)
  ROOT {name} = {{t}}[{rows},{{d}}] dot(dlt, {other}), {second_dims}
}}}}
"""


DH = _form(by_vocabulary=False)
DE = _form(by_vocabulary=True)


def backward_text(form: str, dtype: str = "f32", n: int = N, v: int = V, d: int = D) -> str:
    text = form.format(t=dtype, n=n, v=v, d=d)
    if dtype == "f32":      # the converts between f32 values dropped
        lines = [line for line in text.split("\n")
                 if not line.startswith(("  s = ", "  dlt = "))]
        text = "\n".join(lines).replace("subtract(s, lseb)", "subtract(s0, lseb)").replace(
            "dot(dlt, ", "dot(dl, ")
    return text
