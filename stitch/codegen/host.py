"""Host target: a Kernel IR kernel run on the CPU as a SIMT program (MCJIT via llvmlite).

The compiled function runs blocks [begin, end); a kernel with grid barriers (or global
scratch) runs its whole grid, phase after phase, in the call that is given block 0. A
block's body is split at barriers and warp collectives into regions; each region is a loop
over the block's threads. Variables defined
in the block-level statement lists live in per-thread slots (arrays of `block` elements in a
scratch buffer), so they survive from one region to the next; variables of nested scopes stay
in registers. A For / If that contains a collective runs once per block (validation makes its
bounds / condition uniform; they are evaluated as thread 0) with its body split the same way.
A warp collective is a region that computes each thread's result from the other lanes' slots.

Out-of-bounds loads/stores are caught (bounds_check=True, the default): the access is
redirected to element 0, the first one is recorded, and the call raises CodegenError.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import llvmlite.binding as llvm
import ml_dtypes
import numpy as np
from llvmlite import ir

from stitch.codegen import kir
from stitch.codegen.cache import CompileCache, cache_key
from stitch.codegen.errors import CodegenError
from stitch.codegen.objcheck import host_object_problem, host_objects_cacheable
from stitch.codegen.llvm_emit import (I8, I32, I64, STORAGE_BYTES, Binding, Ctx, KernelEmitter, Scope,
                                      Target, float_suffix, value_type)

LOG = logging.getLogger(__name__)

NUMPY_DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32), "f64": np.dtype(np.float64), "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16), "i1": np.dtype(np.bool_), "i8": np.dtype(np.int8),
    "i32": np.dtype(np.int32), "i64": np.dtype(np.int64), "u8": np.dtype(np.uint8),
    "u32": np.dtype(np.uint32),
}
BUFFER_ALIGNMENT = 64
_ERROR_BYTES = 64  # scratch header: first out-of-bounds access (buffer+1, index, block, thread)
_LIBM = {"exp", "exp2", "log", "log1p", "expm1", "tanh", "sin", "cos", "tan", "erf", "cbrt",
         "pow", "atan2", "fmod"}
_INTRINSICS = {"sqrt": "llvm.sqrt", "floor": "llvm.floor", "ceil": "llvm.ceil",
               "rint": "llvm.roundeven", "round": "llvm.round"}


@functools.lru_cache(maxsize=None)
def _init_llvm() -> None:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    # MCJIT resolves libm (expf...) and libgcc (half conversions) from the process.
    for lib in ("m", "gcc_s"):
        name = ctypes.util.find_library(lib)
        if name:
            llvm.load_library_permanently(name)


def host_machine(opt: int = 2) -> llvm.TargetMachine:
    """A fresh target machine (code generation at LLVM level `opt`; 0: fast instruction
    selection): an MCJIT engine takes ownership of (and frees) its own."""
    _init_llvm()
    target = llvm.Target.from_default_triple()
    return target.create_target_machine(cpu=llvm.get_host_cpu_name(),
                                        features=llvm.get_host_cpu_features().flatten(),
                                        opt=opt, jit=True)


def _aligned(n: int) -> int:
    return (n + BUFFER_ALIGNMENT - 1) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT


class HostTarget(Target):
    """Serialising hooks: threads are loop iterations, blocks are loop iterations."""

    name = "host"

    def __init__(self, bounds_check: bool = True) -> None:
        self.bounds_check = bounds_check
        self.scratch_bytes = _ERROR_BYTES
        self.buffers: dict[str, ir.Value] = {}
        self.buffer_ids: dict[str, int] = {}
        self.block: ir.Value | None = None
        self.scratch: ir.Value | None = None

    # ------------------------------------------------------------ layout

    def _carve(self, em: KernelEmitter, nbytes: int) -> ir.Value:
        offset = self.scratch_bytes
        self.scratch_bytes = _aligned(offset + nbytes)
        return em.entry.gep(self.scratch, [ir.Constant(I64, offset)], inbounds=True,
                            source_etype=I8)

    def begin(self, em: KernelEmitter) -> None:
        k = em.kernel
        ptr = ir.PointerType()
        fnty = ir.FunctionType(ir.VoidType(), [ptr, I32, I32, ptr])
        fn = ir.Function(em.module, fnty, k.name)
        for arg, name in zip(fn.args, ("params", "begin", "end", "scratch")):
            arg.name = name
        em.start_function(fn)
        self.scratch = fn.args[3]
        for i, p in enumerate(k.params):
            slot = em.entry.gep(fn.args[0], [ir.Constant(I64, i)], inbounds=True,
                                source_etype=ptr)
            self.buffers[p.name] = em.entry.load(slot, typ=ptr)
        for s in (*k.shared, *k.scratch):
            # Global scratch lives in the call's scratch too: the grid runs in one worker
            # (see emit_body), so every block sees the same copy.
            self.buffers[s.name] = self._carve(em, s.size * STORAGE_BYTES[s.dtype])
        for i, b in enumerate((*k.params, *k.shared, *k.scratch)):
            self.buffer_ids[b.name] = i

    def slots(self, em: KernelEmitter, dtype: str) -> ir.Value:
        return self._carve(em, em.kernel.block * 8)

    def var_kind(self, top: bool, mutable: bool) -> str:
        if top:
            return "slots"
        return "ptr" if mutable else "ssa"

    # ------------------------------------------------------------ simple hooks

    def thread_idx(self, em: KernelEmitter, ctx: Ctx) -> ir.Value:
        if ctx.tid is None:
            raise CodegenError("host: threadIdx outside a thread loop")
        return ctx.tid

    def block_idx(self, em: KernelEmitter, ctx: Ctx) -> ir.Value:
        return self.block

    def buffer_ptr(self, em: KernelEmitter, name: str) -> ir.Value:
        return self.buffers[name]

    def scratch_ptr(self, em: KernelEmitter, buf: kir.GlobalScratch) -> ir.Value:
        return self.buffers[buf.name]

    def grid_barrier(self, em: KernelEmitter) -> None:
        raise CodegenError("host: a grid barrier is a phase boundary (emit_body), never "
                           "emitted inline")

    def math(self, em: KernelEmitter, fname: str, dtype: str,
             args: list[ir.Value]) -> ir.Value:
        ty = args[0].type
        if fname in _INTRINSICS:
            return em.call(f"{_INTRINSICS[fname]}.{float_suffix(dtype)}", ty, args)
        if fname == "rsqrt":
            root = em.call(f"llvm.sqrt.{float_suffix(dtype)}", ty, args)
            return em.builder.fdiv(ir.Constant(ty, 1.0), root)
        if fname in _LIBM:
            return em.call(fname + ("f" if dtype == "f32" else ""), ty, args)
        raise CodegenError(f"host: no math function {fname}")

    def guard_index(self, em: KernelEmitter, buffer: kir.Buffer, index: ir.Value,
                    ctx: Ctx) -> ir.Value:
        if not self.bounds_check:
            return index
        b = em.builder
        wide = b.sext(index, I64) if index.type != I64 else index
        bad = b.icmp_unsigned(">=", wide, ir.Constant(I64, buffer.size))
        with b.if_then(bad, likely=False):
            first = b.icmp_unsigned("==", b.load(self.scratch, typ=I64), ir.Constant(I64, 0))
            with b.if_then(first):
                tid = ctx.tid if ctx.tid is not None else ir.Constant(I32, 0)
                record = (ir.Constant(I64, self.buffer_ids[buffer.name] + 1), wide,
                          b.sext(self.block, I64), b.sext(tid, I64))
                for i, v in enumerate(record):
                    b.store(v, b.gep(self.scratch, [ir.Constant(I64, i)], source_etype=I64))
        return b.select(bad, ir.Constant(index.type, 0), index)

    # ------------------------------------------------------------ the SIMT driver

    def emit_body(self, em: KernelEmitter) -> None:
        begin, end = em.fn.args[1], em.fn.args[2]
        k = em.kernel
        if grid_synchronized(k):
            # Grid barriers: the phases between them run one after another, each for every
            # block of the grid (a barrier holds when no block starts phase p+1 before all
            # finished phase p). The whole grid runs in the worker given block 0 (one copy
            # of the global scratch); other workers return at once. No variable crosses a
            # grid barrier (validated), so each phase starts with a fresh scope.
            b = em.builder
            with b.if_then(b.icmp_signed("==", begin, ir.Constant(I32, 0))):
                for phase in kir.grid_phases(k.body):
                    def one_block(block: ir.Value, phase: tuple = phase) -> None:
                        self.block = block
                        self._regions(em, phase, em.root.child())
                    em.loop(ir.Constant(I32, 0), ir.Constant(I32, k.grid), ir.Constant(I32, 1),
                            one_block, name="block")
            return

        def one_block(block: ir.Value) -> None:
            self.block = block
            self._regions(em, em.kernel.body, em.root.child())
        em.loop(begin, end, ir.Constant(I32, 1), one_block, name="block")

    def _regions(self, em: KernelEmitter, body: tuple[kir.Stmt, ...], scope: Scope) -> None:
        run: list[kir.Stmt] = []
        for s in body:
            if kir.has_collective(s):
                self._threads(em, run, scope)
                run = []
                self._collective(em, s, scope)
            else:
                run.append(s)
        self._threads(em, run, scope)

    def _threads(self, em: KernelEmitter, run: list[kir.Stmt], scope: Scope) -> None:
        """One region: the statements for every thread of the block in turn."""
        if run:
            em.loop(ir.Constant(I32, 0), ir.Constant(I32, em.kernel.block), ir.Constant(I32, 1),
                    lambda tid: em.stmts(tuple(run), scope, Ctx(tid), top=True), name="thread")

    def _collective(self, em: KernelEmitter, s: kir.Stmt, scope: Scope) -> None:
        uniform = Ctx(ir.Constant(I32, 0))  # validated uniform: thread 0 speaks for all
        if isinstance(s, kir.Barrier):
            return  # the region boundary is the barrier
        if isinstance(s, kir.For):
            start, stop, step = (em.expr(e, scope, uniform) for e in (s.start, s.stop, s.step))

            def body(i: ir.Value) -> None:
                inner = scope.child()
                inner.vars[s.var] = Binding(s.start.dtype, "ssa", i)
                self._regions(em, s.body, inner)
            em.loop(start, stop, step, body, name=f"ufor.{s.var}")
        elif isinstance(s, kir.If):
            cond = em.expr(s.cond, scope, uniform)
            em.branch(cond, lambda: self._regions(em, s.then, scope.child()),
                      (lambda: self._regions(em, s.orelse, scope.child())) if s.orelse else None)
        elif isinstance(s, kir.WarpShuffle):
            self._shuffle(em, s, scope)
        elif isinstance(s, kir.WarpReduce):
            self._reduce(em, s, scope)
        elif isinstance(s, kir.MmaSync):
            self._mma(em, s, scope)
        else:
            raise CodegenError(f"host: unexpected collective {s!r}")

    def _shuffle(self, em: KernelEmitter, s: kir.WarpShuffle, scope: Scope) -> None:
        """dest[t] = value evaluated as the source lane of t (shfl.sync with clamp 31)."""
        dest = Binding(s.value.dtype, "slots", self.slots(em, s.value.dtype))

        def per_thread(tid: ir.Value) -> None:
            b = em.builder
            lane = b.and_(tid, ir.Constant(I32, 31))
            arg = em.expr(s.lane, scope, Ctx(tid))
            if s.mode == "idx":
                src, valid = b.and_(arg, ir.Constant(I32, 31)), None
            else:
                src = b.xor(lane, arg) if s.mode == "xor" else b.add(lane, arg)
                valid = b.icmp_unsigned("<=", src, ir.Constant(I32, 31))
            if valid is not None:
                src = b.select(valid, src, lane)  # out of the warp: own value
            source = b.or_(b.and_(tid, ir.Constant(I32, ~31)), src)
            em.write(dest, em.expr(s.value, scope, Ctx(source)), Ctx(tid))
        em.loop(ir.Constant(I32, 0), ir.Constant(I32, em.kernel.block), ir.Constant(I32, 1),
                per_thread, name="shuffle")
        scope.vars[s.dest] = dest

    def _reduce(self, em: KernelEmitter, s: kir.WarpReduce, scope: Scope) -> None:
        """The GPU's xor butterfly, lane by lane, so rounding matches the NVPTX code."""
        dtype = s.value.dtype
        ty = value_type(dtype)
        dest = Binding(dtype, "slots", self.slots(em, dtype))
        bufs = [em.alloca(ty, 32), em.alloca(ty, 32)]
        c32, one = ir.Constant(I32, 32), ir.Constant(I32, 1)

        def lane_ptr(buf: ir.Value, lane: ir.Value) -> ir.Value:
            return em.builder.gep(buf, [lane], source_etype=ty)

        def per_warp(warp: ir.Value) -> None:
            b = em.builder
            base = b.mul(warp, c32)
            em.loop(ir.Constant(I32, 0), c32, one, lambda lane: b.store(
                em.expr(s.value, scope, Ctx(b.add(base, lane))), lane_ptr(bufs[0], lane)),
                name="lanes")
            for rnd, offset in enumerate((16, 8, 4, 2, 1)):
                cur, nxt = bufs[rnd % 2], bufs[(rnd + 1) % 2]

                def step(lane: ir.Value, cur: ir.Value = cur, nxt: ir.Value = nxt,
                         offset: int = offset) -> None:
                    own = b.load(lane_ptr(cur, lane), typ=ty)
                    other = b.load(lane_ptr(cur, b.xor(lane, ir.Constant(I32, offset))), typ=ty)
                    b.store(em.binary(s.op, dtype, own, other), lane_ptr(nxt, lane))
                em.loop(ir.Constant(I32, 0), c32, one, step, name="butterfly")
            final = bufs[1]  # after 5 rounds
            em.loop(ir.Constant(I32, 0), c32, one, lambda lane: em.write(
                dest, b.load(lane_ptr(final, lane), typ=ty), Ctx(b.add(base, lane))),
                name="lanes")
        em.loop(ir.Constant(I32, 0), ir.Constant(I32, em.kernel.block // 32), one, per_warp,
                name="warp")
        scope.vars[s.dest] = dest


    def _mma(self, em: KernelEmitter, s: kir.MmaSync, scope: Scope) -> None:
        """The tensor-core MMA of each warp: the lanes' fragments gathered into A (16 x k),
        B (k x 8) and C by the PTX layout of s.dtype's shape (see kir.MmaSync), A and B
        rounded to s.dtype (tf32: as cvt.rna.tf32.f32, see round_tf32), D = A B + C in f32
        (k in order), D scattered back as every lane's four results. A wrong fragment index
        in a kernel gives wrong numbers here, as it would on the GPU."""
        f32 = value_type("f32")
        _, _, depth = s.shape
        mats = {"a": em.alloca(f32, 16 * depth), "b": em.alloca(f32, depth * 8),
                "c": em.alloca(f32, 128)}
        acc = em.alloca(f32)
        dests = [Binding("f32", "slots", self.slots(em, "f32")) for _ in s.dest]
        c = functools.partial(ir.Constant, I32)

        def at(name: str, index: ir.Value) -> ir.Value:
            return em.builder.gep(mats[name], [index], source_etype=f32)

        def rounded(v: ir.Value) -> ir.Value:
            if s.dtype == "tf32":
                return round_tf32(em, v)
            return em.from_storage(em.to_storage(v, s.dtype), s.dtype)

        def per_warp(warp: ir.Value) -> None:
            b = em.builder
            base = b.mul(warp, c(32))

            def gather(lane: ir.Value) -> None:
                ctx = Ctx(b.add(base, lane))
                g, q = b.lshr(lane, c(2)), b.and_(lane, c(3))
                for i, e in enumerate(s.a):
                    dr, q_times, dc = mma_a_place(s.dtype, i)
                    row, col = b.add(g, c(dr)), b.add(b.mul(q, c(q_times)), c(dc))
                    b.store(rounded(em.expr(e, scope, ctx)),
                            at("a", b.add(b.mul(row, c(depth)), col)))
                for i, e in enumerate(s.b):
                    q_times, dk = mma_b_place(s.dtype, i)
                    k = b.add(b.mul(q, c(q_times)), c(dk))
                    b.store(rounded(em.expr(e, scope, ctx)), at("b", b.add(b.mul(k, c(8)), g)))
                for i, e in enumerate(s.c):      # C[g + 8 (i >= 2)][2q + i%2]
                    row = b.add(g, c(8 * (i // 2)))
                    col = b.add(b.shl(q, c(1)), c(i % 2))
                    b.store(em.expr(e, scope, ctx), at("c", b.add(b.mul(row, c(8)), col)))
            em.loop(c(0), c(32), c(1), gather, name="mma.gather")

            def element(row: ir.Value, col: ir.Value) -> None:
                slot = at("c", b.add(b.mul(row, c(8)), col))
                b.store(b.load(slot, typ=f32), acc)
                em.loop(c(0), c(depth), c(1), lambda k: b.store(b.fadd(b.load(acc, typ=f32), b.fmul(
                    b.load(at("a", b.add(b.mul(row, c(depth)), k)), typ=f32),
                    b.load(at("b", b.add(b.mul(k, c(8)), col)), typ=f32))), acc), name="mma.k")
                b.store(b.load(acc, typ=f32), slot)
            em.loop(c(0), c(16), c(1), lambda row: em.loop(
                c(0), c(8), c(1), lambda col: element(row, col), name="mma.col"), name="mma.row")

            def scatter(lane: ir.Value) -> None:
                g, q2 = b.lshr(lane, c(2)), b.shl(b.and_(lane, c(3)), c(1))
                for i, dest in enumerate(dests):
                    row = b.add(g, c(8 * (i // 2)))
                    value = b.load(at("c", b.add(b.mul(row, c(8)), b.add(q2, c(i % 2)))), typ=f32)
                    em.write(dest, value, Ctx(b.add(base, lane)))
            em.loop(c(0), c(32), c(1), scatter, name="mma.scatter")
        em.loop(c(0), c(em.kernel.block // 32), c(1), per_warp, name="warp")
        for name, dest in zip(s.dest, dests):
            scope.vars[name] = dest


def grid_synchronized(kernel: kir.Kernel) -> bool:
    """A kernel whose blocks share global scratch or wait for each other: its whole grid
    runs on one host worker."""
    return bool(kernel.scratch) or kir.has_grid_barrier(kernel)


def mma_a_place(dtype: str, i: int) -> tuple[int, int, int]:
    """Where A fragment value ``i`` sits (PTX ISA): (dr, f, dc) with row = g + dr and
    col = f * q + dc (g = lane >> 2, q = lane & 3)."""
    if dtype == "tf32":      # m16n8k8: A[g + 8 (i odd)][q + 4 (i >= 2)]
        return 8 * (i % 2), 1, 4 * (i // 2)
    # m16n8k16: A[g + 8 (i//2 odd)][2q + i%2 + 8 (i >= 4)]
    return 8 * ((i // 2) % 2), 2, i % 2 + 8 * (i // 4)


def mma_b_place(dtype: str, i: int) -> tuple[int, int]:
    """Where B fragment value ``i`` sits: (f, dk) with row k = f * q + dk, column g."""
    if dtype == "tf32":      # m16n8k8: B[q + 4 i][g]
        return 1, 4 * i
    return 2, i % 2 + 8 * (i // 2)      # m16n8k16: B[2q + i%2 + 8 (i >= 2)][g]


def round_tf32(em: KernelEmitter, value: ir.Value) -> ir.Value:
    """``cvt.rna.tf32.f32`` on an f32: keep 10 mantissa bits, to nearest with ties away from
    zero, i.e. add half a tf32 ulp (bit 12) to the magnitude bits and clear bits 0..12.
    Subnormals round the same way (tf32 keeps f32's exponent range); the largest finite
    values round up to inf; inf stays inf; a NaN stays a (quiet) NaN with its upper
    payload. For non-NaN inputs this is the same bit arithmetic as the SASS published
    disassemblies show for the cvt on sm_8x (add 0x1000 unless |x| >= inf, then clear the
    low 13 bits; not checked here: no disassembler on this machine); a NaN whose payload
    lies only in the dropped bits would come out of that SASS as inf, here as a NaN."""
    b = em.builder
    c = functools.partial(ir.Constant, I32)
    bits = b.bitcast(value, I32)
    finite = b.icmp_unsigned("!=", b.and_(bits, c(0x7F800000)), c(0x7F800000))
    rounded = b.and_(b.add(bits, c(0x1000)), c(0xFFFFE000 - (1 << 32)))
    kept = b.and_(bits, c(0xFFFFE000 - (1 << 32)))
    nan = b.fcmp_unordered("uno", value, value)
    special = b.select(nan, b.or_(kept, c(0x00400000)), kept)
    return b.bitcast(b.select(finite, rounded, special), value.type)


@dataclass
class HostKernel:
    """A compiled host kernel; call it with numpy arrays in param order (outputs written in
    place). Blocks are split over `threads` worker threads (ctypes releases the GIL)."""
    kernel: kir.Kernel
    scratch_bytes: int
    threads: int
    llvm_ir: str
    _engine: object = field(repr=False)
    _cfunc: object = field(repr=False)
    from_cache: bool = False        # object code came from the compile cache

    def __call__(self, *arrays: np.ndarray, threads: int | None = None) -> None:
        k = self.kernel
        if len(arrays) != len(k.params):
            raise CodegenError(f"kernel {k.name!r}: {len(arrays)} arrays for "
                               f"{len(k.params)} params")
        for p, a in zip(k.params, arrays):
            self._check_array(p, a)
        pointers = (ctypes.c_void_p * max(1, len(arrays)))(*(a.ctypes.data for a in arrays))
        workers = 1 if grid_synchronized(k) else max(1, min(threads or self.threads, k.grid))
        bounds = np.linspace(0, k.grid, workers + 1).astype(int)
        scratches = [np.zeros(self.scratch_bytes + BUFFER_ALIGNMENT, np.uint8)
                     for _ in range(workers)]
        addrs = [s.ctypes.data + (-s.ctypes.data) % BUFFER_ALIGNMENT for s in scratches]

        def run(w: int) -> None:
            self._cfunc(pointers, int(bounds[w]), int(bounds[w + 1]), addrs[w])
        if workers == 1:
            run(0)
        else:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(run, range(workers)))
        for s, addr in zip(scratches, addrs):
            self._check_errors(s[addr - s.ctypes.data:][:32].view(np.int64))

    def _check_array(self, p: kir.Param, a: np.ndarray) -> None:
        name = self.kernel.name
        if not isinstance(a, np.ndarray):
            raise CodegenError(f"kernel {name!r}: param {p.name!r} is {type(a).__name__}, "
                               "not a numpy array")
        if a.dtype != NUMPY_DTYPES[p.dtype]:
            raise CodegenError(f"kernel {name!r}: param {p.name!r} wants {p.dtype} "
                               f"({NUMPY_DTYPES[p.dtype]}), got {a.dtype}")
        if a.size != p.size:
            raise CodegenError(f"kernel {name!r}: param {p.name!r} wants {p.size} elements, "
                               f"got {a.size}")
        if not a.flags.c_contiguous or (p.is_output and not a.flags.writeable):
            raise CodegenError(f"kernel {name!r}: param {p.name!r} must be a C-contiguous"
                               f"{' writeable' if p.is_output else ''} array")

    def _check_errors(self, record: np.ndarray) -> None:
        if record[0]:
            buffers = (*self.kernel.params, *self.kernel.shared, *self.kernel.scratch)
            buf = buffers[int(record[0]) - 1]
            raise CodegenError(f"kernel {self.kernel.name!r}: out-of-bounds access "
                               f"{buf.name}[{int(record[1])}] (size {buf.size}) in block "
                               f"{int(record[2])} thread {int(record[3])}")


def emit_host_ir(kernel: kir.Kernel, bounds_check: bool = True) -> tuple[str, int]:
    """LLVM IR text of the host function and the scratch bytes it needs per worker."""
    kernel.validate()
    tm = host_machine()
    module = ir.Module(name=kernel.name)
    module.triple = llvm.get_process_triple()
    module.data_layout = str(tm.target_data)
    target = HostTarget(bounds_check)
    KernelEmitter(kernel, target, module).emit()
    return str(module), target.scratch_bytes


def _object_key(text: str, opt: int) -> str:
    """What the host object code depends on: the IR, the CPU it is built for, the options
    and the LLVM that builds it."""
    import llvmlite
    return cache_key("host-object", text, llvm.get_process_triple(), llvm.get_host_cpu_name(),
                     llvm.get_host_cpu_features().flatten(), str(opt), llvmlite.__version__)


def _optimize(module: llvm.ModuleRef, tm: llvm.TargetMachine, opt: int) -> None:
    pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=opt))
    pb.getModulePassManager().run(module, pb)


ObjectBuilder = Callable[[str, "int | None", int], bytes]
"""Builds object code for (IR text, IR speed level or None, code-generation level), e.g. in
an IsolatedWorker child with ``build_object``."""


def build_object(ir_text: str, opt: int | None, codegen_level: int) -> bytes:
    """Object code for host IR: parsed, verified, optimized at speed level ``opt`` (None: no
    IR passes), compiled for this CPU at ``codegen_level``. Module-level so that a child
    process can run it (``stitch.codegen.isolation``): the caller then only loads the object."""
    tm = host_machine(codegen_level)
    try:
        module = llvm.parse_assembly(ir_text)
        module.verify()
    except RuntimeError as exc:
        raise CodegenError(f"LLVM rejected the host IR: {exc}") from exc
    _engine, obj = _compile_with_object(module, tm, opt)
    if not obj:
        raise CodegenError("MCJIT produced no object code")
    return obj


def _compile_with_object(module: llvm.ModuleRef, tm: llvm.TargetMachine,
                         opt: int | None) -> tuple[object, bytes]:
    """(MCJIT engine, its object code) for ``module``, optimized at ``opt`` first."""
    if opt is not None:
        _optimize(module, tm, opt)
    engine = llvm.create_mcjit_compiler(module, tm)
    objects: list[bytes] = []
    engine.set_object_cache(lambda _module, buffer: objects.append(bytes(buffer)),
                            lambda _module: None)
    engine.finalize_object()
    return engine, objects[0] if objects else b""


def _load_object(module: llvm.ModuleRef, tm: llvm.TargetMachine, obj: bytes) -> object:
    """An MCJIT engine for ``module`` whose code is ``obj`` (nothing is compiled here)."""
    problem = host_object_problem(obj)
    if problem is not None:
        raise CodegenError(f"object code for {module.name!r} is unusable: {problem}")
    engine = llvm.create_mcjit_compiler(module, tm)
    engine.set_object_cache(lambda _module, _buffer: None, lambda _module: obj)
    engine.finalize_object()
    return engine


def jit_module(module: llvm.ModuleRef, tm: llvm.TargetMachine, *, opt: int | None,
               cache: CompileCache | None, key: str,
               object_builder: ObjectBuilder | None = None,
               codegen_level: int = 2) -> tuple[object, bool]:
    """(finalized MCJIT engine for the verified, unoptimized `module`, whether its object code
    came from `cache`). ``opt``: the IR pipeline's speed level; None runs no IR passes.
    ``object_builder``: where the object code is built instead of this process (an
    IsolatedWorker child: ``build_object``; ``codegen_level`` is ``tm``'s level, passed on);
    only loading happens here then. Object code is built under the cache's per-key lock (concurrent
    processes build it once) and a cached object reaches MCJIT only after it authenticated
    and passed `objcheck.host_object_problem` (else it is rebuilt): a bad entry can never
    abort the process or run foreign code."""
    if object_builder is not None:
        def isolated() -> bytes:
            return object_builder(str(module), opt, codegen_level)
        if cache is None or not cache.enabled or not host_objects_cacheable():
            return _load_object(module, tm, isolated()), False
        built_here: list[bool] = []

        def build_isolated() -> bytes:
            built_here.append(True)
            return isolated()
        obj = cache.get_or_create(key, build_isolated, validate=host_object_problem)
        return _load_object(module, tm, obj), not built_here
    if cache is None or not cache.enabled or not host_objects_cacheable():
        if opt is not None:
            _optimize(module, tm, opt)
        engine = llvm.create_mcjit_compiler(module, tm)
        engine.finalize_object()
        return engine, False
    built: dict[str, object] = {}

    def build() -> bytes:
        built["engine"], obj = _compile_with_object(module, tm, opt)
        return obj

    obj = cache.get_or_create(key, build, validate=host_object_problem)
    if "engine" in built:
        return built["engine"], False
    return _load_object(module, tm, obj), True


def compile_host(kernel: kir.Kernel, *, threads: int | None = None,
                 bounds_check: bool = True, opt: int = 2,
                 cache: CompileCache | None = None) -> HostKernel:
    """Compile `kernel` for the CPU. All llvmlite work happens on the calling thread. With
    `cache`, the object code comes from there when an authenticated, well-formed entry exists
    (optimization and code generation are skipped), else it is built under the key's lock and
    stored (see `jit_module`)."""
    text, scratch = emit_host_ir(kernel, bounds_check)
    tm = host_machine()
    try:
        module = llvm.parse_assembly(text)
        module.verify()
    except RuntimeError as exc:
        raise CodegenError(f"kernel {kernel.name!r}: LLVM rejected the host IR: {exc}") from exc
    key = _object_key(text, opt) if cache is not None else ""
    engine, from_cache = jit_module(module, tm, opt=opt, cache=cache, key=key)
    address = engine.get_function_address(kernel.name)
    if not address:
        raise CodegenError(f"kernel {kernel.name!r}: MCJIT produced no function")
    proto = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                             ctypes.c_void_p)
    n = threads if threads is not None else min(os.cpu_count() or 1, 8)
    LOG.debug("kernel %s: host build%s, %d scratch bytes", kernel.name,
              " (object from the cache)" if from_cache else "", scratch)
    return HostKernel(kernel, scratch, max(1, n), text, engine, proto(address),
                      from_cache=from_cache)
