"""Human-readable, CUDA-like rendering of a Kernel IR kernel (for logs, reports and tests)."""
from __future__ import annotations

from stitch.codegen import kir
from stitch.codegen.errors import CodegenError

C_TYPES = {"f32": "float", "f64": "double", "f16": "half", "bf16": "bfloat16", "i1": "bool",
           "i8": "int8_t", "i32": "int", "i64": "int64_t", "u8": "uint8_t", "u32": "uint32_t"}

_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "rem": "%", "and": "&", "or": "|",
          "xor": "^", "shl": "<<", "shr_arith": ">>", "eq": "==", "ne": "!=", "lt": "<",
          "le": "<=", "gt": ">", "ge": ">="}
_SPECIAL = {kir.ThreadIdx: "threadIdx.x", kir.BlockIdx: "blockIdx.x",
            kir.BlockDim: "blockDim.x", kir.GridDim: "gridDim.x"}


def format_expr(e: kir.Expr) -> str:
    if isinstance(e, kir.Const):
        return _const(e)
    if isinstance(e, kir.Ref):
        return e.name
    if type(e) in _SPECIAL:
        return _SPECIAL[type(e)]
    if isinstance(e, kir.Load):
        return f"{e.buffer}[{format_expr(e.index)}]"
    if isinstance(e, (kir.Binary, kir.Compare)):
        a, b = format_expr(e.a), format_expr(e.b)
        if e.op == "shr_logical":
            return f"((unsigned){a} >> {b})"
        if e.op in _INFIX:
            return f"({a} {_INFIX[e.op]} {b})"
        return f"{e.op}({a}, {b})"
    if isinstance(e, kir.Unary):
        a = format_expr(e.a)
        if e.op == "neg":
            return f"(-{a})"
        if e.op == "not":
            return f"(!{a})" if e.a.dtype == "i1" else f"(~{a})"
        return f"{e.op}({a})"
    if isinstance(e, kir.Select):
        return f"({format_expr(e.cond)} ? {format_expr(e.a)} : {format_expr(e.b)})"
    if isinstance(e, kir.Convert):
        return f"({C_TYPES[e.dtype]}){format_expr(e.a)}"
    if isinstance(e, kir.Bitcast):
        return f"bit_cast<{C_TYPES[e.dtype]}>({format_expr(e.a)})"
    raise CodegenError(f"cannot print expression {e!r}")


def _const(e: kir.Const) -> str:
    if e.dtype == "i1":
        return "true" if e.value else "false"
    if e.dtype in kir.FLOAT_DTYPES:
        text = repr(float(e.value))
        return text + "f" if e.dtype == "f32" and text[-1].isdigit() else text
    suffix = "L" if e.dtype == "i64" else "u" if e.dtype in ("u8", "u32") else ""
    return str(int(e.value)) + suffix


def _stmts(body: tuple[kir.Stmt, ...], indent: int, out: list[str]) -> None:
    pad = "  " * indent
    for s in body:
        if isinstance(s, kir.Let):
            out.append(f"{pad}const {C_TYPES[s.expr.dtype]} {s.name} = {format_expr(s.expr)};")
        elif isinstance(s, kir.Local):
            init = format_expr(s.init) if s.init is not None else "0"
            out.append(f"{pad}{C_TYPES[s.dtype]} {s.name} = {init};")
        elif isinstance(s, kir.Assign):
            out.append(f"{pad}{s.name} = {format_expr(s.expr)};")
        elif isinstance(s, kir.Store):
            out.append(f"{pad}{s.buffer}[{format_expr(s.index)}] = {format_expr(s.value)};")
        elif isinstance(s, kir.AtomicAdd):
            name = {"add": "atomicAdd", "max": "atomicMax", "min": "atomicMin"}[s.op]
            out.append(f"{pad}{name}(&{s.buffer}[{format_expr(s.index)}], "
                       f"{format_expr(s.value)});")
        elif isinstance(s, kir.For):
            t = C_TYPES[s.start.dtype]
            out.append(f"{pad}for ({t} {s.var} = {format_expr(s.start)}; {s.var} < "
                       f"{format_expr(s.stop)}; {s.var} += {format_expr(s.step)}) {{")
            _stmts(s.body, indent + 1, out)
            out.append(f"{pad}}}")
        elif isinstance(s, kir.If):
            out.append(f"{pad}if ({format_expr(s.cond)}) {{")
            _stmts(s.then, indent + 1, out)
            if s.orelse:
                out.append(f"{pad}}} else {{")
                _stmts(s.orelse, indent + 1, out)
            out.append(f"{pad}}}")
        elif isinstance(s, kir.Barrier):
            out.append(f"{pad}__syncthreads();")
        elif isinstance(s, kir.GridBarrier):
            out.append(f"{pad}grid_sync();  // every block of the grid")
        elif isinstance(s, kir.WarpShuffle):
            out.append(f"{pad}const {C_TYPES[s.value.dtype]} {s.dest} = __shfl_{s.mode}_sync("
                       f"0xffffffff, {format_expr(s.value)}, {format_expr(s.lane)});")
        elif isinstance(s, kir.WarpReduce):
            out.append(f"{pad}const {C_TYPES[s.value.dtype]} {s.dest} = warp_reduce_{s.op}("
                       f"{format_expr(s.value)});")
        elif isinstance(s, kir.MmaSync):
            frags = "; ".join("{" + ", ".join(format_expr(e) for e in part) + "}"
                              for part in (s.a, s.b, s.c))
            m, n, k = s.shape
            out.append(f"{pad}float {', '.join(s.dest)}; mma_m{m}n{n}k{k}_{s.dtype}("
                       f"{frags});")
        else:
            raise CodegenError(f"cannot print statement {s!r}")


def format_kernel(kernel: kir.Kernel) -> str:
    """CUDA-like pseudo code: launch dims, params (sizes, outputs), shared buffers, body."""
    params = ", ".join(
        f"{'' if p.is_output else 'const '}{C_TYPES[p.dtype]}* {p.name} /*[{p.size}]"
        f"{' out' if p.is_output else ''}*/" for p in kernel.params)
    out = [f"// launch: grid={kernel.grid} block={kernel.block}",
           f"__global__ void {kernel.name}({params}) {{"]
    out += [f"  __shared__ {C_TYPES[s.dtype]} {s.name}[{s.size}];" for s in kernel.shared]
    out += [f"  __device__ {C_TYPES[s.dtype]} {s.name}[{s.size}];  // global scratch"
            for s in kernel.scratch]
    _stmts(kernel.body, 1, out)
    out.append("}")
    return "\n".join(out) + "\n"
