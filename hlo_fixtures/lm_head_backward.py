"""The LM head + cross-entropy backward as two GEMM chains (dH: tokens walk the vocabulary,
dE: vocabulary rows walk the tokens), HLO templates over sizes and types: what the chain
recognizer and the chain kernels are checked on, and the LM-head bench prices."""
from __future__ import annotations

# The tokens, vocabulary and hidden sizes the tests use: no tile divides them.
N, V, D = 40, 300, 24

DH = """HloModule dh
ENTRY e {{
  h = {t}[{n},{d}] parameter(0)
  emb = {t}[{v},{d}] parameter(1)
  lse = f32[{n}] parameter(2)
  label = s32[{n}] parameter(3)
  g = f32[{n}] parameter(4)
  s0 = {t}[{n},{v}] dot(h, emb), lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}
  s = f32[{n},{v}] convert(s0)
  lseb = f32[{n},{v}] broadcast(lse), dimensions={{0}}
  x = f32[{n},{v}] subtract(s, lseb)
  p = f32[{n},{v}] exponential(x)
  col = s32[{n},{v}] iota(), iota_dimension=1
  labelb = s32[{n},{v}] broadcast(label), dimensions={{0}}
  hit = pred[{n},{v}] compare(col, labelb), direction=EQ
  one = f32[] constant(1)
  zero = f32[] constant(0)
  oneb = f32[{n},{v}] broadcast(one), dimensions={{}}
  zerob = f32[{n},{v}] broadcast(zero), dimensions={{}}
  onehot = f32[{n},{v}] select(hit, oneb, zerob)
  d = f32[{n},{v}] subtract(p, onehot)
  gb = f32[{n},{v}] broadcast(g), dimensions={{0}}
  dl = f32[{n},{v}] multiply(d, gb)
  dlt = {t}[{n},{v}] convert(dl)
  ROOT dh = {t}[{n},{d}] dot(dlt, emb), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""
DE = """HloModule de
ENTRY e {{
  h = {t}[{n},{d}] parameter(0)
  emb = {t}[{v},{d}] parameter(1)
  lse = f32[{n}] parameter(2)
  label = s32[{n}] parameter(3)
  g = f32[{n}] parameter(4)
  s0 = {t}[{v},{n}] dot(emb, h), lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}
  s = f32[{v},{n}] convert(s0)
  lseb = f32[{v},{n}] broadcast(lse), dimensions={{1}}
  x = f32[{v},{n}] subtract(s, lseb)
  p = f32[{v},{n}] exponential(x)
  row = s32[{v},{n}] iota(), iota_dimension=0
  labelb = s32[{v},{n}] broadcast(label), dimensions={{1}}
  hit = pred[{v},{n}] compare(row, labelb), direction=EQ
  one = f32[] constant(1)
  zero = f32[] constant(0)
  oneb = f32[{v},{n}] broadcast(one), dimensions={{}}
  zerob = f32[{v},{n}] broadcast(zero), dimensions={{}}
  onehot = f32[{v},{n}] select(hit, oneb, zerob)
  d = f32[{v},{n}] subtract(p, onehot)
  gb = f32[{v},{n}] broadcast(g), dimensions={{1}}
  dl = f32[{v},{n}] multiply(d, gb)
  dlt = {t}[{v},{n}] convert(dl)
  ROOT de = {t}[{v},{d}] dot(dlt, h), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""


def backward_text(form: str, dtype: str = "f32", n: int = N, v: int = V, d: int = D) -> str:
    text = form.format(t=dtype, n=n, v=v, d=d)
    if dtype == "f32":      # the converts between f32 values dropped
        lines = [line for line in text.split("\n")
                 if not line.startswith(("  s = ", "  dlt = "))]
        text = "\n".join(lines).replace("subtract(s, lseb)", "subtract(s0, lseb)").replace(
            "dot(dlt, ", "dot(dl, ")
    return text
