"""The one lowering of Kernel IR to llvmlite.ir, parameterised by a `Target` (hooks object).

The emitter owns expression semantics (integer division, NaN-propagating min/max, storage
conversions, ...) and structured control flow; a target decides how a kernel function is
declared, where variables live, how thread/block ids, buffers, barriers, shuffles and math
functions are reached. NVPTX runs the body as written (SIMT-native); the host target
serialises threads and drives the body itself through the public methods here.
"""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Callable

from llvmlite import ir

from stitch.codegen import kir
from stitch.codegen.errors import CodegenError

LOG = logging.getLogger(__name__)

I1, I8, I16, I32, I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()

VALUE_TYPES: dict[str, ir.Type] = {"f32": F32, "f64": F64, "i1": I1, "i8": I8, "u8": I8,
                                   "i32": I32, "u32": I32, "i64": I64}
# Buffers hold bool as a byte (numpy bool) and bf16 as its 16 bits.
STORAGE_TYPES: dict[str, ir.Type] = {**VALUE_TYPES, "i1": I8, "f16": F16, "bf16": I16}
STORAGE_BYTES = {"f32": 4, "f64": 8, "i1": 1, "i8": 1, "u8": 1, "i32": 4, "u32": 4, "i64": 8,
                 "f16": 2, "bf16": 2}
INT_BITS = {"i1": 1, "i8": 8, "u8": 8, "i32": 32, "u32": 32, "i64": 64}
UNSIGNED = kir.UNSIGNED_DTYPES | {"i1"}

# Math functions a target provides (generic names; f32 or f64 operands).
MATH_FUNCTIONS = frozenset({"exp", "exp2", "log", "log1p", "expm1", "sqrt", "rsqrt", "tanh",
                            "sin", "cos", "tan", "erf", "cbrt", "floor", "ceil", "rint",
                            "round", "pow", "atan2", "fmod"})
_UNARY_MATH = {"exp": "exp", "exp2": "exp2", "log": "log", "log1p": "log1p", "expm1": "expm1",
               "sqrt": "sqrt", "rsqrt": "rsqrt", "tanh": "tanh", "sin": "sin", "cos": "cos",
               "tan": "tan", "erf": "erf", "cbrt": "cbrt", "floor": "floor", "ceil": "ceil",
               "round_half_even": "rint", "round_half_away": "round"}
_FCMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def value_type(dtype: str) -> ir.Type:
    return VALUE_TYPES[dtype]


def storage_type(dtype: str) -> ir.Type:
    return STORAGE_TYPES[dtype]


def float_suffix(dtype: str) -> str:
    """Overload suffix of LLVM intrinsics (llvm.floor.f32)."""
    return {"f32": "f32", "f64": "f64"}[dtype]


@dataclass
class Binding:
    """Where a variable lives. ssa: `value` is the value; ptr: a scalar at `value`;
    slots: a per-thread array at `value`, indexed by the context's thread (host)."""
    dtype: str
    kind: str
    value: ir.Value


class Scope:
    """Lexical scope chain of variable bindings."""

    def __init__(self, parent: "Scope | None" = None) -> None:
        self.parent = parent
        self.vars: dict[str, Binding] = {}

    def lookup(self, name: str) -> Binding:
        scope: Scope | None = self
        while scope is not None:
            if name in scope.vars:
                return scope.vars[name]
            scope = scope.parent
        raise CodegenError(f"undefined variable {name!r} (kernel not validated?)")

    def child(self) -> "Scope":
        return Scope(self)


@dataclass(frozen=True)
class Ctx:
    """Emission context. tid: the simulated thread (host, i32); None: the target's own."""
    tid: ir.Value | None = None


class Target:
    """Target hooks. Defaults suit a SIMT-native target that runs the body as written."""

    name = "abstract"
    # Bytes every buffer param is aligned to (0: only its element size is known).
    param_align = 0

    def begin(self, em: "KernelEmitter") -> None:
        """Create the kernel function (em.start_function) and anything module-level."""
        raise NotImplementedError

    def emit_body(self, em: "KernelEmitter") -> None:
        em.stmts(em.kernel.body, em.root, Ctx(), top=True)

    def thread_idx(self, em: "KernelEmitter", ctx: Ctx) -> ir.Value:
        raise NotImplementedError

    def block_idx(self, em: "KernelEmitter", ctx: Ctx) -> ir.Value:
        raise NotImplementedError

    def buffer_ptr(self, em: "KernelEmitter", name: str) -> ir.Value:
        raise NotImplementedError

    def guard_index(self, em: "KernelEmitter", buffer: kir.Buffer, index: ir.Value,
                    ctx: Ctx) -> ir.Value:
        """A hook for bounds checks; the index actually used."""
        return index

    def math(self, em: "KernelEmitter", fname: str, dtype: str,
             args: list[ir.Value]) -> ir.Value:
        raise NotImplementedError

    def var_kind(self, top: bool, mutable: bool) -> str:
        """Storage of a Let/Local defined in the kernel's top-level statement lists (`top`)."""
        return "ptr" if mutable else "ssa"

    def slots(self, em: "KernelEmitter", dtype: str) -> ir.Value:
        raise CodegenError(f"target {self.name} has no per-thread slots")

    def barrier(self, em: "KernelEmitter") -> None:
        raise CodegenError(f"target {self.name} cannot emit a barrier inline")

    def shuffle32(self, em: "KernelEmitter", value: ir.Value, lane: ir.Value,
                  mode: str) -> ir.Value:
        """Shuffle an i32 or float across the warp (full mask)."""
        raise CodegenError(f"target {self.name} cannot emit a shuffle inline")

    def mma(self, em: "KernelEmitter", s: kir.MmaSync, a: list[ir.Value], b: list[ir.Value],
            c: list[ir.Value]) -> list[ir.Value]:
        """One lane's D fragment of a warp MMA. SIMT-native default: the NVVM intrinsic."""
        return nvvm_mma(em, s.dtype, a, b, c)


    # Address space of global memory on SIMT-native targets (NVPTX's 1).
    global_addrspace = 1

    def _module_global(self, em: "KernelEmitter", name: str, ty: ir.Type) -> ir.Value:
        """A zero-initialised global of the module (found again by name)."""
        gv = em.module.globals.get(name)
        if gv is None:
            gv = ir.GlobalVariable(em.module, ty, name, addrspace=self.global_addrspace)
            gv.linkage = "internal"
            gv.initializer = ir.Constant(ty, None)
            gv.align = 16
        return gv

    def scratch_ptr(self, em: "KernelEmitter", buf: kir.GlobalScratch) -> ir.Value:
        """Element pointer of a kernel-owned global scratch buffer: a module global on a
        SIMT-native target (no launcher involvement; undefined contents at kernel start)."""
        arr = ir.ArrayType(storage_type(buf.dtype), buf.size)
        gv = self._module_global(em, f"{em.kernel.name}__{buf.name}", arr)
        zero = ir.Constant(I32, 0)
        return gv.gep([zero, zero])

    def emit_relaunched_body(self, em: "KernelEmitter") -> None:
        """A kernel with grid_sync="relaunch", launched once per phase on one stream: every
        thread reads the phase number (the module-global generation) and runs that phase;
        after a block barrier each block's thread 0 counts its block in, and the last block
        of the launch resets the count and advances the phase (mod the phase count). Every
        block has read the phase before the last one arrives, and the next launch starts
        after this one ends (stream order), so no block waits on another: any grid runs."""
        b = em.builder
        phases = kir.grid_phases(em.kernel.body)
        sync = self._module_global(em, f"{em.kernel.name}__grid_sync", ir.ArrayType(I32, 2))
        zero = ir.Constant(I32, 0)
        count = sync.gep([zero, zero])
        generation = sync.gep([zero, ir.Constant(I32, 1)])
        phase = b.load_atomic(generation, "monotonic", 4, typ=I32)
        for i, body in enumerate(phases):
            with b.if_then(b.icmp_unsigned("==", phase, ir.Constant(I32, i))):
                em.stmts(body, em.root.child(), Ctx(), top=True)
        self.barrier(em)
        tid = self.thread_idx(em, Ctx())
        with b.if_then(b.icmp_unsigned("==", tid, zero)):
            b.fence("acq_rel", "device")
            arrived = b.atomic_rmw("add", count, ir.Constant(I32, 1), "monotonic")
            with b.if_then(b.icmp_unsigned("==", arrived, ir.Constant(I32, em.kernel.grid - 1))):
                b.store_atomic(zero, count, "monotonic", 4)
                after = b.add(phase, ir.Constant(I32, 1))
                wrapped = b.select(b.icmp_unsigned("==", after, ir.Constant(I32, len(phases))),
                                   zero, after)
                b.store_atomic(wrapped, generation, "monotonic", 4)

    def grid_barrier(self, em: "KernelEmitter") -> None:
        """Software grid barrier on a module-global (arrivals, generation) pair; every block
        must be resident (the schedule's grid is within the occupancy limit). The block's
        threads meet at a block barrier; thread 0 reads the generation, fences (its block's
        writes before its arrival, fence.acq_rel.gpu / membar.gl) and counts itself in with
        an atomic add; the last block to arrive resets the count to 0 and bumps the
        generation, the others spin on a relaxed (volatile) load until it changes; a fence,
        and a block barrier releases the block. The count is back at 0 after every barrier
        and the generation only grows, so the pair never needs zeroing between launches:
        the loader's zero initialisation is enough (two launches of one kernel must not run
        at once, which in-order streams ensure)."""
        b = em.builder
        sync = self._module_global(em, f"{em.kernel.name}__grid_sync", ir.ArrayType(I32, 2))
        zero = ir.Constant(I32, 0)
        count = sync.gep([zero, zero])
        generation = sync.gep([zero, ir.Constant(I32, 1)])
        self.barrier(em)
        tid = self.thread_idx(em, Ctx())
        with b.if_then(b.icmp_unsigned("==", tid, zero)):
            seen = b.load_atomic(generation, "monotonic", 4, typ=I32)
            b.fence("acq_rel", "device")
            arrived = b.atomic_rmw("add", count, ir.Constant(I32, 1), "monotonic")
            last = b.icmp_unsigned("==", arrived, ir.Constant(I32, em.kernel.grid - 1))
            with b.if_else(last) as (on_last, on_other):
                with on_last:
                    b.store_atomic(zero, count, "monotonic", 4)
                    b.fence("acq_rel", "device")
                    b.atomic_rmw("add", generation, ir.Constant(I32, 1), "monotonic")
                with on_other:
                    spin = em.fn.append_basic_block("grid_sync.spin")
                    done = em.fn.append_basic_block("grid_sync.done")
                    b.branch(spin)
                    b.position_at_end(spin)
                    now = b.load_atomic(generation, "monotonic", 4, typ=I32)
                    b.cbranch(b.icmp_unsigned("==", now, seen), spin, done)
                    b.position_at_end(done)
            b.fence("acq_rel", "device")
        self.barrier(em)


def _pack_pair(em: "KernelEmitter", dtype: str, lo: ir.Value, hi: ir.Value) -> ir.Value:
    """Two f32 fragment values as the 32-bit register mma.sync reads (first value low)."""
    b = em.builder
    if dtype == "bf16":
        lo16, hi16 = (b.zext(em.to_storage(v, "bf16"), I32) for v in (lo, hi))
        return b.or_(lo16, b.shl(hi16, ir.Constant(I32, 16)))
    vec = ir.Constant(ir.VectorType(F16, 2), ir.Undefined)
    vec = b.insert_element(vec, b.fptrunc(lo, F16), ir.Constant(I32, 0))
    return b.insert_element(vec, b.fptrunc(hi, F16), ir.Constant(I32, 1))


def nvvm_mma(em: "KernelEmitter", dtype: str, a: list[ir.Value], b: list[ir.Value],
             c: list[ir.Value]) -> list[ir.Value]:
    """The NVVM ``mma`` intrinsic (f32 accumulate, sm_80+): ``m16n8k16.row.col`` for bf16 /
    f16 (two values packed per 32-bit register), ``m16n8k8.row.col.tf32`` for tf32 (one
    value per register, each rounded by ``cvt.rna.tf32.f32``: the MMA itself would only
    drop the low 13 bits)."""
    if dtype == "tf32":
        name = "llvm.nvvm.mma.m16n8k8.row.col.tf32"
        args = [em.call("llvm.nvvm.f2tf32.rna", I32, [v]) for v in (*a, *b)]
    else:
        name = ("llvm.nvvm.mma.m16n8k16.row.col.bf16" if dtype == "bf16"
                else "llvm.nvvm.mma.m16n8k16.row.col.f32.f32")
        args = [_pack_pair(em, dtype, a[i], a[i + 1]) for i in range(0, 8, 2)]
        args += [_pack_pair(em, dtype, b[i], b[i + 1]) for i in range(0, 4, 2)]
    args += list(c)
    result = em.call(name, ir.LiteralStructType([F32] * 4), args)
    return [em.builder.extract_value(result, i) for i in range(4)]


class KernelEmitter:
    """Lowers one validated kernel into a function of `module`."""

    def __init__(self, kernel: kir.Kernel, target: Target, module: ir.Module, *,
                 simplify: bool = True) -> None:
        self.kernel = kernel
        self.buffers = kernel.buffers               # (the property builds a dict per call)
        # Pure operations emitted once per basic block and integer identities (x + 0) left
        # out (``in_block``, ``_int_identity``); False: everything as written, the reference
        # that LLVM's machine code is compared with (it must not change).
        self.simplify = simplify
        self.target = target
        self.module = module
        self._expr_depth = 0                        # expr's recursion depth
        self._emitted: dict[int, ir.Value] = {}     # id -> value, within one top-level expr
        self._reuse_block: ir.Block | None = None   # the block _reusable's values are in
        self._reusable: dict[tuple, tuple] = {}     # in_block's (value, operands) there
        self.root = Scope()
        self.fn: ir.Function | None = None
        self.builder: ir.IRBuilder = ir.IRBuilder()
        self.entry: ir.IRBuilder = ir.IRBuilder()  # allocas and function-wide setup
        self._start: ir.Block | None = None

    # ------------------------------------------------------------ function frame

    def emit(self) -> ir.Function:
        LOG.debug("emitting kernel %s for %s", self.kernel.name, self.target.name)
        self.target.begin(self)
        if self.fn is None:
            raise CodegenError(f"target {self.target.name} created no function")
        self.target.emit_body(self)
        self.builder.ret_void()
        self.entry.branch(self._start)
        return self.fn

    def start_function(self, fn: ir.Function) -> None:
        self.fn = fn
        self.entry = ir.IRBuilder(fn.append_basic_block("entry"))
        self._start = fn.append_basic_block("start")
        self.builder = ir.IRBuilder(self._start)

    def alloca(self, ty: ir.Type, count: int = 1) -> ir.Value:
        size = ir.Constant(I32, count) if count != 1 else None
        return self.entry.alloca(ty, size=size)

    def declare(self, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
        fn = self.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(ret, args), name)
        return fn

    def call(self, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
        return self.builder.call(self.declare(name, ret, [a.type for a in args]), args)

    # ------------------------------------------------------------ control flow

    def loop(self, start: ir.Value, stop: ir.Value, step: ir.Value,
             body: Callable[[ir.Value], None], name: str = "for") -> None:
        """for (i = start; i < stop; i += step) body(i); signed compare."""
        b = self.builder
        counter = self.alloca(start.type)
        b.store(start, counter)
        cond = self.fn.append_basic_block(f"{name}.cond")
        loop_body = self.fn.append_basic_block(f"{name}.body")
        done = self.fn.append_basic_block(f"{name}.end")
        b.branch(cond)
        b.position_at_end(cond)
        i = b.load(counter, typ=start.type)
        b.cbranch(b.icmp_signed("<", i, stop), loop_body, done)
        b.position_at_end(loop_body)
        body(i)
        b.store(b.add(i, step), counter)
        b.branch(cond)
        b.position_at_end(done)

    def branch(self, cond: ir.Value, then: Callable[[], None],
               orelse: Callable[[], None] | None = None) -> None:
        if orelse is None:
            with self.builder.if_then(cond):
                then()
            return
        with self.builder.if_else(cond) as (on_true, on_false):
            with on_true:
                then()
            with on_false:
                orelse()

    # ------------------------------------------------------------ variables

    def thread(self, ctx: Ctx) -> ir.Value:
        return ctx.tid if ctx.tid is not None else self.target.thread_idx(self, ctx)

    def define(self, scope: Scope, name: str, dtype: str, value: ir.Value, *, mutable: bool,
               top: bool, ctx: Ctx) -> Binding:
        kind = self.target.var_kind(top, mutable)
        if kind == "ssa":
            binding = Binding(dtype, "ssa", value)
        elif kind == "ptr":
            binding = Binding(dtype, "ptr", self.alloca(value_type(dtype)))
            self.write(binding, value, ctx)
        elif kind == "slots":
            binding = Binding(dtype, "slots", self.target.slots(self, dtype))
            self.write(binding, value, ctx)
        else:
            raise CodegenError(f"unknown variable kind {kind!r}")
        scope.vars[name] = binding
        return binding

    def _slot(self, binding: Binding, ctx: Ctx) -> ir.Value:
        return self.builder.gep(binding.value, [self.thread(ctx)], inbounds=True,
                                source_etype=value_type(binding.dtype))

    def read(self, binding: Binding, ctx: Ctx) -> ir.Value:
        ty = value_type(binding.dtype)
        if binding.kind == "ssa":
            return binding.value
        if binding.kind == "ptr":
            return self.builder.load(binding.value, typ=ty)
        return self.builder.load(self._slot(binding, ctx), typ=ty)

    def write(self, binding: Binding, value: ir.Value, ctx: Ctx) -> None:
        if binding.kind == "ptr":
            self.builder.store(value, binding.value)
        elif binding.kind == "slots":
            self.builder.store(value, self._slot(binding, ctx))
        else:
            raise CodegenError("assignment to an immutable binding")

    # ------------------------------------------------------------ statements

    def stmts(self, body: tuple[kir.Stmt, ...], scope: Scope, ctx: Ctx, top: bool) -> None:
        for s in body:
            self.stmt(s, scope, ctx, top)

    def stmt(self, s: kir.Stmt, scope: Scope, ctx: Ctx, top: bool) -> None:
        b = self.builder
        if isinstance(s, kir.Let):
            self.define(scope, s.name, s.expr.dtype, self.expr(s.expr, scope, ctx),
                        mutable=False, top=top, ctx=ctx)
        elif isinstance(s, kir.Local):
            init = self.expr(s.init, scope, ctx) if s.init is not None else \
                self.const(0, s.dtype)
            self.define(scope, s.name, s.dtype, init, mutable=True, top=top, ctx=ctx)
        elif isinstance(s, kir.Assign):
            self.write(scope.lookup(s.name), self.expr(s.expr, scope, ctx), ctx)
        elif isinstance(s, kir.Store):
            buf = self.buffers[s.buffer]
            index = self.expr(s.index, scope, ctx)
            computed = self.expr(s.value, scope, ctx)
            value = self.in_block(("to_storage", buf.dtype), (computed,),
                                  lambda: self.to_storage(computed, buf.dtype))
            b.store(value, self.access_ptr(buf, s.index, scope, ctx, index),
                    align=self.access_align(buf, s.index))
        elif isinstance(s, kir.AtomicAdd):
            buf = self.buffers[s.buffer]
            index = self.expr(s.index, scope, ctx)
            value = self.expr(s.value, scope, ctx)
            ptr = self.element_ptr(buf, index, ctx)
            if s.op != "add" or buf.dtype in ("bf16", "f16"):
                # No target has a bf16 atomic add on every arch, nor any float atomic
                # max/min: a compare-and-swap loop, each add rounded to the narrow type (as
                # XLA's scatter-add does) by the same rounding as stores.
                self.atomic_combine(ptr, value, buf.dtype, s.value.dtype, s.op)
            else:
                op = "fadd" if s.value.dtype in kir.FLOAT_DTYPES else "add"
                # Relaxed: only the sum matters (red.global.add on NVPTX, lock add / cmpxchg
                # on x86).
                b.atomic_rmw(op, ptr, value, "monotonic")
        elif isinstance(s, kir.For):
            start, stop, step = (self.expr(e, scope, ctx) for e in (s.start, s.stop, s.step))

            def body(i: ir.Value) -> None:
                inner = scope.child()
                inner.vars[s.var] = Binding(s.start.dtype, "ssa", i)  # the loop's i dominates
                self.stmts(s.body, inner, ctx, top=False)
            self.loop(start, stop, step, body, name=f"for.{s.var}")
        elif isinstance(s, kir.If):
            cond = self.expr(s.cond, scope, ctx)
            self.branch(cond, lambda: self.stmts(s.then, scope.child(), ctx, top=False),
                        (lambda: self.stmts(s.orelse, scope.child(), ctx, top=False))
                        if s.orelse else None)
        elif isinstance(s, kir.Barrier):
            self.target.barrier(self)
        elif isinstance(s, kir.GridBarrier):
            self.target.grid_barrier(self)
        elif isinstance(s, kir.WarpShuffle):
            lane = self.expr(s.lane, scope, ctx)
            value = self.shuffle(self.expr(s.value, scope, ctx), s.value.dtype, lane, s.mode)
            self.define(scope, s.dest, s.value.dtype, value, mutable=False, top=top, ctx=ctx)
        elif isinstance(s, kir.WarpReduce):
            value = self.warp_reduce(self.expr(s.value, scope, ctx), s.value.dtype, s.op)
            self.define(scope, s.dest, s.value.dtype, value, mutable=False, top=top, ctx=ctx)
        elif isinstance(s, kir.MmaSync):
            frags = [[self.expr(e, scope, ctx) for e in part] for part in (s.a, s.b, s.c)]
            for name, value in zip(s.dest, self.target.mma(self, s, *frags)):
                self.define(scope, name, "f32", value, mutable=False, top=top, ctx=ctx)
        else:
            raise CodegenError(f"cannot emit statement {s!r}")

    # ------------------------------------------------------------ warp collectives

    def shuffle(self, value: ir.Value, dtype: str, lane: ir.Value, mode: str) -> ir.Value:
        """Any value dtype through the target's 32-bit shuffle (64-bit: two halves)."""
        b, shfl = self.builder, self.target.shuffle32
        if dtype in ("f32", "i32", "u32"):
            return shfl(self, value, lane, mode)
        if dtype in ("i1", "i8", "u8"):
            return b.trunc(shfl(self, b.zext(value, I32), lane, mode), value.type)
        bits = b.bitcast(value, I64) if dtype == "f64" else value
        lo = shfl(self, b.trunc(bits, I32), lane, mode)
        hi = shfl(self, b.trunc(b.lshr(bits, ir.Constant(I64, 32)), I32), lane, mode)
        joined = b.or_(b.zext(lo, I64), b.shl(b.zext(hi, I64), ir.Constant(I64, 32)))
        return b.bitcast(joined, F64) if dtype == "f64" else joined

    def warp_reduce(self, value: ir.Value, dtype: str, op: str) -> ir.Value:
        """Butterfly: op(own, lane ^ offset) for offsets 16..1; every lane ends with the result."""
        for offset in (16, 8, 4, 2, 1):
            other = self.shuffle(value, dtype, ir.Constant(I32, offset), "xor")
            value = self.binary(op, dtype, value, other)
        return value

    # ------------------------------------------------------------ buffers

    def element_ptr(self, buf: kir.Buffer, index: ir.Value, ctx: Ctx) -> ir.Value:
        index = self.target.guard_index(self, buf, index, ctx)
        base = self.target.scratch_ptr(self, buf) if isinstance(buf, kir.GlobalScratch) \
            else self.target.buffer_ptr(self, buf.name)
        return self.in_block(("gep", True, buf.dtype), (base, index),
                             lambda: self.builder.gep(base, [index], inbounds=True,
                                                      source_etype=storage_type(buf.dtype)))

    def access_ptr(self, buf: kir.Buffer, index: kir.Expr, scope: Scope, ctx: Ctx,
                   value: ir.Value | None = None) -> ir.Value:
        """The address of ``buf[index]`` (``value``: the index, already emitted). Where the
        target knows its params' alignment (no bounds checks), ``x + c`` is addressed as
        (buf + x) + c: a vector group's accesses then share one base address, which LLVM
        would otherwise extend to 64 bits in different ways (sext / zext nneg) per element
        and no longer see as consecutive. Not inbounds: x alone may lie outside."""
        if self.target.param_align and isinstance(buf, kir.Param) and \
                isinstance(index, kir.Binary) and index.op == "add" and \
                isinstance(index.b, kir.Const) and index.b.dtype == "i32" and index.b.value > 0:
            base = self.builder.gep(self.target.buffer_ptr(self, buf.name),
                                    [self.expr(index.a, scope, ctx)],
                                    source_etype=storage_type(buf.dtype))
            return self.builder.gep(base, [ir.Constant(I32, index.b.value)],
                                    source_etype=storage_type(buf.dtype))
        if value is None:
            value = self.expr(index, scope, ctx)
        return self.element_ptr(buf, value, ctx)

    def access_align(self, buf: kir.Buffer, index: kir.Expr) -> int:
        """Alignment of ``buf[index]`` in bytes: the element size, or where the target
        knows its params' alignment, what the index's arithmetic proves (a vector group's
        first element: a multiple of its width, ``kir.multiple_of``). LLVM cannot always
        see it itself (a div/rem pair becomes x - (x/n)*n behind a freeze), and its NVPTX
        load/store vectorizer merges a group only from an aligned first access."""
        size = STORAGE_BYTES[buf.dtype]
        if not self.target.param_align or not isinstance(buf, kir.Param):
            return size
        k = kir.multiple_of(index)
        step = k & -k if k else self.target.param_align      # largest power of 2 dividing it
        return max(size, min(self.target.param_align, size * step))

    def atomic_combine(self, ptr: ir.Value, value: ir.Value, dtype: str, value_dtype: str,
                       op: str) -> None:
        """*ptr = op(*ptr, value) as a compare-and-swap loop on the element's bits (any
        storage type of 16, 32 or 64 bits), the op computed as ``binary`` computes it."""
        b = self.builder
        width = {"bf16": 16, "f16": 16, "f32": 32, "i32": 32, "u32": 32,
                 "f64": 64, "i64": 64}.get(dtype)
        if width is None:
            raise CodegenError(f"atomic {op} of {dtype} is not generated")
        bits_type = ir.IntType(width)
        start = b.load_atomic(b.bitcast(ptr, bits_type.as_pointer(ptr.type.addrspace)),
                              "monotonic", width // 8, typ=bits_type)
        entry = b.block
        retry = b.append_basic_block(f"atomic_{op}.retry")
        done = b.append_basic_block(f"atomic_{op}.done")
        b.branch(retry)
        b.position_at_end(retry)
        seen = b.phi(bits_type, f"atomic_{op}.seen")
        seen.add_incoming(start, entry)
        storage = storage_type(dtype)
        raw = seen if storage == bits_type else b.bitcast(seen, storage)
        combined = self.binary(op, value_dtype, self.from_storage(raw, dtype), value)
        stored = self.to_storage(combined, dtype)
        new_bits = stored if stored.type == bits_type else b.bitcast(stored, bits_type)
        pair = b.cmpxchg(b.bitcast(ptr, bits_type.as_pointer(ptr.type.addrspace)), seen,
                         new_bits, "monotonic", "monotonic")
        seen.add_incoming(b.extract_value(pair, 0), b.block)
        b.cbranch(b.extract_value(pair, 1), done, retry)
        b.position_at_end(done)

    def from_storage(self, raw: ir.Value, dtype: str) -> ir.Value:
        b = self.builder
        if dtype == "f16":
            return b.fpext(raw, F32)
        if dtype == "bf16":  # bf16 is the top half of an f32: exact
            return b.bitcast(b.shl(b.zext(raw, I32), ir.Constant(I32, 16)), F32)
        if dtype == "i1":
            return b.icmp_unsigned("!=", raw, ir.Constant(I8, 0))
        return raw

    def to_storage(self, value: ir.Value, dtype: str) -> ir.Value:
        b = self.builder
        if dtype == "f16":
            return b.fptrunc(value, F16)
        if dtype == "bf16":  # round to nearest even by hand: sm_70 and x86 lack a cvt
            bits = b.bitcast(value, I32)
            high = b.lshr(bits, ir.Constant(I32, 16))
            bias = b.add(ir.Constant(I32, 0x7FFF), b.and_(high, ir.Constant(I32, 1)))
            rounded = b.trunc(b.lshr(b.add(bits, bias), ir.Constant(I32, 16)), I16)
            quiet_nan = b.or_(b.trunc(high, I16), ir.Constant(I16, 0x40))
            return b.select(b.fcmp_unordered("uno", value, value), quiet_nan, rounded)
        if dtype == "i1":
            return b.zext(value, I8)
        return value

    # ------------------------------------------------------------ expressions

    def const(self, value: float | int | bool, dtype: str) -> ir.Constant:
        ty = value_type(dtype)
        if dtype in kir.FLOAT_DTYPES:
            return ir.Constant(ty, float(value))
        bits = INT_BITS[dtype]
        v = int(value) & ((1 << bits) - 1)
        if bits > 1 and v >= 1 << (bits - 1):
            v -= 1 << bits  # two's complement, so u32 0xffffffff prints as i32 -1
        return ir.Constant(ty, v)

    def expr(self, e: kir.Expr, scope: Scope, ctx: Ctx) -> ir.Value:
        """``e``'s value. Lowered expressions are DAGs: a subexpression object met again
        within one top-level expression reuses the value already emitted (emission time is
        Python's, and LLVM would merge the copies anyway). Safe: an expression emits no
        blocks and no stores, so the first value dominates every later use."""
        if self._expr_depth == 0:
            self._emitted = {}
        key = id(e)
        got = self._emitted.get(key)
        if got is not None:
            return got
        self._expr_depth += 1
        try:
            value = self._expr(e, scope, ctx)
        finally:
            self._expr_depth -= 1
        self._emitted[key] = value
        return value

    def _expr(self, e: kir.Expr, scope: Scope, ctx: Ctx) -> ir.Value:
        b = self.builder
        if isinstance(e, kir.Const):
            return self.const(e.value, e.dtype)
        if isinstance(e, kir.Ref):
            return self.read(scope.lookup(e.name), ctx)
        if isinstance(e, kir.ThreadIdx):
            return self.thread(ctx)
        if isinstance(e, kir.BlockIdx):
            return self.target.block_idx(self, ctx)
        if isinstance(e, kir.BlockDim):  # launch dims are part of the kernel: constants
            return ir.Constant(I32, self.kernel.block)
        if isinstance(e, kir.GridDim):
            return ir.Constant(I32, self.kernel.grid)
        if isinstance(e, kir.Load):
            buf = self.buffers[e.buffer]
            ptr = self.access_ptr(buf, e.index, scope, ctx)
            raw = b.load(ptr, typ=storage_type(buf.dtype), align=self.access_align(buf, e.index))
            return self.from_storage(raw, buf.dtype)
        if isinstance(e, kir.Binary):
            a, c = self.expr(e.a, scope, ctx), self.expr(e.b, scope, ctx)
            if e.a.dtype in kir.FLOAT_DTYPES and e.op not in _PLAIN_FLOAT_BINARY:
                return self.binary(e.op, e.a.dtype, a, c)    # a math call: not reused
            return self.in_block(("binary", e.op, e.a.dtype), (a, c),
                                 lambda: self.binary(e.op, e.a.dtype, a, c))
        if isinstance(e, kir.Compare):
            a, c = self.expr(e.a, scope, ctx), self.expr(e.b, scope, ctx)
            return self.in_block(("compare", e.op, e.a.dtype), (a, c),
                                 lambda: self.compare(e.op, e.a.dtype, a, c))
        if isinstance(e, kir.Unary):
            a = self.expr(e.a, scope, ctx)
            if e.a.dtype in kir.FLOAT_DTYPES and e.op in _MATH_UNARY:
                return self.unary(e.op, e.a.dtype, a)
            return self.in_block(("unary", e.op, e.a.dtype), (a,),
                                 lambda: self.unary(e.op, e.a.dtype, a))
        if isinstance(e, kir.Select):
            cond, a, c = (self.expr(x, scope, ctx) for x in (e.cond, e.a, e.b))
            return self.in_block(("select",), (cond, a, c), lambda: b.select(cond, a, c))
        if isinstance(e, kir.Convert):
            a = self.expr(e.a, scope, ctx)
            return self.in_block(("convert", e.a.dtype, e.dtype), (a,),
                                 lambda: self.convert(a, e.a.dtype, e.dtype))
        if isinstance(e, kir.Bitcast):
            value = self.expr(e.a, scope, ctx)
            ty = value_type(e.dtype)
            if value.type == ty:
                return value
            return self.in_block(("bitcast", e.dtype), (value,), lambda: b.bitcast(value, ty))
        raise CodegenError(f"cannot emit expression {e!r}")

    def in_block(self, op: tuple, operands: tuple[ir.Value, ...],
                 make: Callable[[], ir.Value]) -> ir.Value:
        """The value of the pure operation ``op`` on ``operands``: the one already emitted
        in the current basic block (which dominates the rest of the block), else ``make()``'s.
        Why: statements repeat their index arithmetic (12-17% of the largest kernels'
        instructions computed again in the same block); LLVM's first EarlyCSE merged the
        copies, after Python had emitted them and LLVM had parsed them. Only within a
        block: sharing across blocks (special-register reads hoisted to the entry) and
        sharing the ``buf + x`` bases of ``access_ptr`` changed some kernels' machine code."""
        if not self.simplify:
            return make()
        block = self.builder.block
        if block is not self._reuse_block:
            self._reuse_block, self._reusable = block, {}
        reusable = self._reusable
        key = (op, *map(_operand_key, operands))
        got = reusable.get(key)
        if got is not None:
            return got[0]
        value = make()
        if self.builder.block is block:    # (a target hook may have branched)
            # The operands are kept with the value: their ids in the key stay theirs.
            reusable[key] = (value, operands)
        return value

    def binary(self, op: str, dtype: str, a: ir.Value, c: ir.Value) -> ir.Value:
        b = self.builder
        if dtype in kir.FLOAT_DTYPES:
            simple = {"add": b.fadd, "sub": b.fsub, "mul": b.fmul, "div": b.fdiv}
            if op in simple:
                return simple[op](a, c)
            if op in ("max", "min"):  # NaN-propagating like XLA and np.maximum / np.minimum
                pick = b.select(b.fcmp_ordered(">" if op == "max" else "<", a, c), a, c)
                return b.select(b.fcmp_unordered("uno", a, a), a, pick)
            return self.target.math(self, {"rem": "fmod"}.get(op, op), dtype, [a, c])
        unsigned = dtype in UNSIGNED
        same = _int_identity(op, a, c) if self.simplify else None
        if same is not None:
            return same
        simple = {"add": b.add, "sub": b.sub, "mul": b.mul, "and": b.and_, "or": b.or_,
                  "xor": b.xor}
        if op in simple:
            return simple[op](a, c)
        if op in ("max", "min"):
            cmp = b.icmp_unsigned if unsigned else b.icmp_signed
            return b.select(cmp(">" if op == "max" else "<", a, c), a, c)
        if op in ("div", "rem"):
            return self._int_divrem(op, dtype, a, c)
        return self._shift(op, dtype, a, c)

    def _int_divrem(self, op: str, dtype: str, a: ir.Value, c: ir.Value) -> ir.Value:
        """XLA semantics, never trapping: x/0 = -1 (all ones), x%0 = x, MIN/-1 = MIN, MIN%-1 = 0."""
        b, ty = self.builder, a.type
        if isinstance(c, ir.Constant) and isinstance(c.constant, int) and c.constant != 0 \
                and (dtype in UNSIGNED or c.constant != -1):
            # A constant divisor (index arithmetic: nearly every div/rem a kernel has) cannot
            # trap: one instruction, not the guarded sequence (emission time is Python's).
            if op == "div":
                return (b.udiv if dtype in UNSIGNED else b.sdiv)(a, c)
            return (b.urem if dtype in UNSIGNED else b.srem)(a, c)
        zero = b.icmp_unsigned("==", c, ir.Constant(ty, 0))
        bad = zero
        if dtype not in UNSIGNED:
            overflow = b.and_(b.icmp_signed("==", a, self.const(-(1 << (INT_BITS[dtype] - 1)),
                                                                  dtype)),
                              b.icmp_signed("==", c, ir.Constant(ty, -1)))
            bad = b.or_(zero, overflow)
        safe = b.select(bad, ir.Constant(ty, 1), c)  # MIN/1 = MIN and MIN%1 = 0 as wanted
        if op == "div":
            q = (b.udiv if dtype in UNSIGNED else b.sdiv)(a, safe)
            return b.select(zero, ir.Constant(ty, -1), q)
        r = (b.urem if dtype in UNSIGNED else b.srem)(a, safe)
        return b.select(zero, a, r)

    def _shift(self, op: str, dtype: str, a: ir.Value, c: ir.Value) -> ir.Value:
        """XLA semantics: a shift by >= the bit width gives 0 (arithmetic: the sign fill)."""
        b, ty = self.builder, a.type
        width = ir.Constant(ty, INT_BITS[dtype])
        too_far = b.icmp_unsigned(">=", c, width)
        safe = b.select(too_far, ir.Constant(ty, 0), c)
        if op == "shl":
            return b.select(too_far, ir.Constant(ty, 0), b.shl(a, safe))
        if op == "shr_logical":
            return b.select(too_far, ir.Constant(ty, 0), b.lshr(a, safe))
        fill = b.ashr(a, ir.Constant(ty, INT_BITS[dtype] - 1))
        return b.select(too_far, fill, b.ashr(a, safe))

    def compare(self, op: str, dtype: str, a: ir.Value, c: ir.Value) -> ir.Value:
        b = self.builder
        if dtype in kir.FLOAT_DTYPES:  # numpy: NaN compares false except !=
            fcmp = b.fcmp_unordered if op == "ne" else b.fcmp_ordered
            return fcmp(_FCMP[op], a, c)
        icmp = b.icmp_unsigned if dtype in UNSIGNED else b.icmp_signed
        return icmp(_FCMP[op], a, c)

    def unary(self, op: str, dtype: str, a: ir.Value) -> ir.Value:
        b, ty = self.builder, a.type
        if dtype in kir.FLOAT_DTYPES:
            one = ir.Constant(ty, 1.0)
            if op in _UNARY_MATH:
                return self.target.math(self, _UNARY_MATH[op], dtype, [a])
            if op == "neg":
                return b.fneg(a)
            if op == "abs":
                return self.fabs(a, dtype)
            if op == "sign":  # +-1, keeps +-0 and NaN like np.sign
                neg = b.select(b.fcmp_ordered("<", a, ir.Constant(ty, 0.0)),
                               ir.Constant(ty, -1.0), a)
                return b.select(b.fcmp_ordered(">", a, ir.Constant(ty, 0.0)), one, neg)
            if op == "is_finite":
                return b.fcmp_ordered("!=", self.fabs(a, dtype), ir.Constant(ty, float("inf")))
            if op in ("round_to_f16", "round_to_bf16"):
                narrow = op.removeprefix("round_to_")
                return self.from_storage(self.to_storage(a, narrow), narrow)
            if op == "logistic":
                e = self.target.math(self, "exp", dtype, [b.fneg(a)])
                return b.fdiv(one, b.fadd(one, e))
        else:
            zero = ir.Constant(ty, 0)
            if op == "not":
                return b.not_(a)
            if op == "neg":
                return b.sub(zero, a)
            if dtype in UNSIGNED:
                if op == "abs":
                    return a
                if op == "sign":
                    return b.zext(b.icmp_unsigned("!=", a, zero), ty)
            elif op == "abs":
                return b.select(b.icmp_signed("<", a, zero), b.sub(zero, a), a)
            elif op == "sign":
                pos = b.zext(b.icmp_signed(">", a, zero), ty)
                return b.sub(pos, b.zext(b.icmp_signed("<", a, zero), ty))
        raise CodegenError(f"Unary({op}) cannot take {dtype}")

    def fabs(self, a: ir.Value, dtype: str) -> ir.Value:
        return self.call(f"llvm.fabs.{float_suffix(dtype)}", a.type, [a])

    def convert(self, a: ir.Value, src: str, dst: str) -> ir.Value:
        b = self.builder
        if src == dst:
            return a
        ty = value_type(dst)
        if src in kir.FLOAT_DTYPES:
            if dst in kir.FLOAT_DTYPES:
                return b.fpext(a, ty) if dst == "f64" else b.fptrunc(a, ty)
            if dst == "i1":  # NaN is truthy, like bool(nan)
                return b.fcmp_unordered("!=", a, ir.Constant(a.type, 0.0))
            # Saturating (NaN -> 0): never poison, same answer on both targets.
            kind = "fptoui" if dst in UNSIGNED else "fptosi"
            return self.call(f"llvm.{kind}.sat.i{INT_BITS[dst]}.{float_suffix(src)}", ty, [a])
        if dst in kir.FLOAT_DTYPES:
            return (b.uitofp if src in UNSIGNED else b.sitofp)(a, ty)
        if dst == "i1":
            return b.icmp_unsigned("!=", a, ir.Constant(a.type, 0))
        src_bits, dst_bits = INT_BITS[src], INT_BITS[dst]
        if dst_bits < src_bits:
            return b.trunc(a, ty)
        if dst_bits > src_bits:
            return (b.zext if src in UNSIGNED else b.sext)(a, ty)
        return a  # same width, other signedness: same bits


# Integer operations with an identity operand: (op, the identity, whether it may stand left).
_IDENTITIES = {"add": (0, True), "sub": (0, False), "or": (0, True), "xor": (0, True),
               "mul": (1, True), "and": (-1, True)}


def _int_identity(op: str, a: ir.Value, c: ir.Value) -> ir.Value | None:
    """The operand ``op`` leaves unchanged when the other is its identity constant (x + 0,
    x * 1, ...), else None. Index arithmetic is full of them (offset 0 of a tile's first
    row: 5% of the largest attention kernel's instructions); the first InstCombine
    removes each, so emitting none saves Python's time and LLVM's parse and passes."""
    rule = _IDENTITIES.get(op)
    if rule is None:
        return None
    identity, commutes = rule
    if _is_int_constant(c, identity):
        return a
    if commutes and _is_int_constant(a, identity):
        return c
    return None


def _is_int_constant(value: ir.Value, wanted: int) -> bool:
    return isinstance(value, ir.Constant) and isinstance(value.constant, int) \
        and value.constant == wanted


# Float binary operations emitted as plain instructions (the rest call the target's math).
_PLAIN_FLOAT_BINARY = frozenset({"add", "sub", "mul", "div", "max", "min"})
# Float unary operations that call the target's math.
_MATH_UNARY = frozenset(_UNARY_MATH) | {"logistic"}
_DOUBLE = struct.Struct("<d")


def _operand_key(value: ir.Value) -> tuple:
    """Equal for operands that are the same value: the object itself (alive in the module),
    a constant by its type and bits (0.0 and -0.0 differ)."""
    if isinstance(value, ir.Constant):
        constant = value.constant
        if isinstance(constant, float):
            return ("float", str(value.type), _DOUBLE.pack(constant))
        if isinstance(constant, int):
            return ("int", str(value.type), constant)
    return ("value", id(value))
