"""Synthetic HLO graphs of a chosen size for the explorer scaling benchmark.

A stack of transformer-like blocks: layer norm (two row reductions, rsqrt), a GEMM, bias +
tanh-GELU, a second GEMM, residual add, plus a softmax-like branch over a second tensor —
about 40 ops per block, so graph size grows by stacking blocks."""
from __future__ import annotations

ADD = """add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
max {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] maximum(a, b)
}
"""


def _block(i: int, x: str, rows: int, width: int) -> tuple[list[str], str]:
    t = f"f32[{rows},{width}]"
    r = f"f32[{rows}]"
    p = f"b{i}_"
    lines = [
        f"{p}sum = {r} reduce({x}, zero), dimensions={{1}}, to_apply=add",
        f"{p}mean = {r} divide({p}sum, nrow)",
        f"{p}meanb = {t} broadcast({p}mean), dimensions={{0}}",
        f"{p}c = {t} subtract({x}, {p}meanb)",
        f"{p}sq = {t} multiply({p}c, {p}c)",
        f"{p}vs = {r} reduce({p}sq, zero), dimensions={{1}}, to_apply=add",
        f"{p}var = {r} divide({p}vs, nrow)",
        f"{p}ve = {r} add({p}var, epsr)",
        f"{p}rs = {r} rsqrt({p}ve)",
        f"{p}rb = {t} broadcast({p}rs), dimensions={{0}}",
        f"{p}y = {t} multiply({p}c, {p}rb)",
        f"{p}g = {t} multiply({p}y, gammab)",
        f"{p}ln = {t} add({p}g, betab)",
        f"{p}h = {t} dot({p}ln, w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}",
        f"{p}hb = {t} add({p}h, betab)",
        f"{p}h3 = {t} multiply({p}hb, {p}hb)",
        f"{p}h3b = {t} multiply({p}h3, {p}hb)",
        f"{p}h3c = {t} multiply({p}h3b, c044)",
        f"{p}inner = {t} add({p}hb, {p}h3c)",
        f"{p}inner2 = {t} multiply({p}inner, c079)",
        f"{p}th = {t} tanh({p}inner2)",
        f"{p}th1 = {t} add({p}th, oneb)",
        f"{p}half = {t} multiply({p}hb, halfb)",
        f"{p}gelu = {t} multiply({p}half, {p}th1)",
        f"{p}o = {t} dot({p}gelu, w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}",
        f"{p}mx = {r} reduce({p}o, ninf), dimensions={{1}}, to_apply=max",
        f"{p}mxb = {t} broadcast({p}mx), dimensions={{0}}",
        f"{p}sh = {t} subtract({p}o, {p}mxb)",
        f"{p}ex = {t} exponential({p}sh)",
        f"{p}es = {r} reduce({p}ex, zero), dimensions={{1}}, to_apply=add",
        f"{p}esb = {t} broadcast({p}es), dimensions={{0}}",
        f"{p}sm = {t} divide({p}ex, {p}esb)",
        f"{p}res = {t} add({p}sm, {x})",
        f"{p}cl = {t} clamp(lo, {p}res, hi)",
        f"{p}out = {t} add({p}cl, {p}ln)",
    ]
    return lines, f"{p}out"


OPS_PER_BLOCK = 35


def synthetic_hlo(target_ops: int, rows: int = 512, width: int = 512) -> str:
    """HLO text with about ``target_ops`` ops (whole blocks; at least one)."""
    blocks = max(1, round(target_ops / OPS_PER_BLOCK))
    t = f"f32[{rows},{width}]"
    lines = [
        f"x = {t} parameter(0)",
        f"w = f32[{width},{width}] parameter(1)",
        f"gamma = f32[{width}] parameter(2)",
        f"beta = f32[{width}] parameter(3)",
        "zero = f32[] constant(0)",
        "ninf = f32[] constant(-inf)",
        f"width_c = f32[] constant({width})",
        "eps_c = f32[] constant(1e-5)",
        "k044 = f32[] constant(0.044715)",
        "k079 = f32[] constant(0.7978845608)",
        "k1 = f32[] constant(1)",
        "khalf = f32[] constant(0.5)",
        "klo = f32[] constant(-100)",
        "khi = f32[] constant(100)",
        f"nrow = f32[{rows}] broadcast(width_c), dimensions={{}}",
        f"epsr = f32[{rows}] broadcast(eps_c), dimensions={{}}",
        f"gammab = {t} broadcast(gamma), dimensions={{1}}",
        f"betab = {t} broadcast(beta), dimensions={{1}}",
        f"c044 = {t} broadcast(k044), dimensions={{}}",
        f"c079 = {t} broadcast(k079), dimensions={{}}",
        f"oneb = {t} broadcast(k1), dimensions={{}}",
        f"halfb = {t} broadcast(khalf), dimensions={{}}",
        f"lo = {t} broadcast(klo), dimensions={{}}",
        f"hi = {t} broadcast(khi), dimensions={{}}",
    ]
    x = "x"
    for i in range(blocks):
        block, x = _block(i, x, rows, width)
        lines.extend(block)
    lines.append(f"ROOT result = {t} negate({x})")
    body = "\n  ".join(lines)
    return f"HloModule synthetic_{blocks}\n{ADD}\nENTRY main {{\n  {body}\n}}\n"
