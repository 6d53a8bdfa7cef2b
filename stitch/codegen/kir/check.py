"""Kernel IR validation: names, types, buffers, and block collectives only in uniform
control flow (``KernelChecker``; ``Kernel.validate`` runs it once per kernel)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Protocol

from stitch.codegen.errors import CodegenError

from .nodes import (ATOMIC_DTYPES, ATOMIC_OPS, Assign, AtomicAdd, BINARY_DTYPES, Binary, Bitcast,
                    BlockDim, BlockIdx, Buffer, COLLECTIVES, Compare, Const, Convert, Expr,
                    FLOAT_DTYPES, For, GRID_SYNC_MODES, GlobalScratch, GridBarrier, GridDim,
                    INDEX_DTYPES, If, Let, Load, Local, MAX_INDEX_ELEMENTS, MmaSync,
                    NUMERIC_DTYPES, Param, Ref, STORAGE_DTYPES, Select, Shared, Stmt, Store,
                    ThreadIdx, UNARY_DTYPES, Unary, VALUE_DTYPES, WarpReduce, WarpShuffle,
                    bitcast_problem, expr_refs, is_identifier, reads_thread_idx, sub_exprs,
                    value_dtype, walk_stmts)


class CheckedKernel(Protocol):
    """What the checker reads of a kernel."""
    name: str
    params: tuple[Param, ...]
    shared: tuple[Shared, ...]
    grid: int
    block: int
    body: tuple[Stmt, ...]
    scratch: tuple[GlobalScratch, ...]
    grid_sync: str
    register_budget: int | None


# A walk is repeated only for a Local read as uniform by an expression that came out
# uniform (else its turning varying later changes no answer of the walk). Tests turn it off
# to compare with repeating for every such read.
RELEVANT_READS_ONLY = True


@dataclass
class _Var:
    dtype: str
    kind: str        # "let" | "local" | "loop" | "lane" (shuffle / reduce result)
    varying: bool    # may differ between threads of a block
    key: int         # id() of the defining statement (Locals' varying-ness is a fixed point)


_INT_RANGES = {"i8": (-2**7, 2**7 - 1), "i32": (-2**31, 2**31 - 1), "i64": (-2**63, 2**63 - 1),
               "u8": (0, 2**8 - 1), "u32": (0, 2**32 - 1), "i1": (0, 1)}


def _describe(stmt: Stmt) -> str:
    key = getattr(stmt, "name", None) or getattr(stmt, "dest", None) or getattr(stmt, "var", None) \
        or getattr(stmt, "buffer", None)
    return f"{type(stmt).__name__}({key})" if key else type(stmt).__name__


class KernelChecker:
    """Walks a kernel with a scope stack. Locals assigned thread-dependent values (or under
    thread-dependent control flow) are varying; that is a fixed point, so the walk repeats
    until no Local changes, and only the last walk reports collectives in divergent code."""

    def __init__(self, kernel: CheckedKernel) -> None:
        self.k = kernel
        self.buffers: dict[str, Buffer] = {}
        self.varying_locals: set[int] = set()
        self.changed = False
        self.final = False
        self._checked: dict[int, Expr] = {}      # expressions whose scope-free checks passed
        self._read_uniform: set[int] = set()     # Locals this walk read while uniform

    def fail(self, where: str, msg: str) -> None:
        raise CodegenError(f"kernel {self.k.name!r}: {where}: {msg}")

    def run(self) -> None:
        """Walk the body until the varying set settles; the pass that changes nothing saw
        the settled set and is the final one. A Local that turns varying only counts as a
        change when this walk read it earlier as uniform (a loop's back edge): reads after
        the change saw it varying already, and only a read that left its expression uniform
        counts (an accumulator read beside the thread index does not), so most kernels
        take one walk. The final-only
        check (a collective under thread-dependent control flow) runs in every pass:
        divergence only grows as the varying set does, so what fails in an early pass fails
        in the final one too."""
        self._header()
        self.final = True
        walks, most = 0, None
        # (At most one walk per statement and two more: counted only once a walk repeats.)
        while most is None or walks < most:
            self.changed = False
            self._read_uniform.clear()
            self._body(self.k.body, [], None, "body")
            if not self.changed:
                return
            walks += 1
            if most is None:
                most = len(list(walk_stmts(self.k.body))) + 2
        self._body(self.k.body, [], None, "body")

    def _header(self) -> None:
        k = self.k
        if not isinstance(k.name, str) or not is_identifier(k.name):
            raise CodegenError(f"kernel name {k.name!r} is not an identifier")
        if not isinstance(k.grid, int) or k.grid < 1:
            self.fail("launch", f"grid {k.grid!r} must be a positive int")
        if not isinstance(k.block, int) or k.block % 32 or not 32 <= k.block <= 1024:
            self.fail("launch", f"block {k.block!r} must be a multiple of 32 in [32, 1024]")
        if k.grid_sync not in GRID_SYNC_MODES:
            self.fail("launch", f"grid_sync {k.grid_sync!r} is not one of {GRID_SYNC_MODES}")
        if k.register_budget is not None and not 16 <= k.register_budget <= 255:
            self.fail("launch", f"register budget {k.register_budget} is outside 16..255")
        for kind, bufs in (("param", k.params), ("shared", k.shared), ("scratch", k.scratch)):
            for b in bufs:
                cls = {"param": Param, "shared": Shared, "scratch": GlobalScratch}[kind]
                if not isinstance(b, cls):
                    self.fail(kind, f"{b!r} is not a {cls.__name__}")
                if not is_identifier(b.name):
                    self.fail(kind, f"buffer name {b.name!r} is not an identifier")
                if b.name in self.buffers:
                    self.fail(kind, f"buffer {b.name!r} defined twice")
                if b.dtype not in STORAGE_DTYPES:
                    self.fail(kind, f"buffer {b.name!r} has unknown dtype {b.dtype!r}")
                if kind == "scratch" and b.dtype not in VALUE_DTYPES - {"i1"}:
                    self.fail(kind, f"scratch {b.name!r} must hold a value dtype, not {b.dtype}")
                if not isinstance(b.size, int) or b.size < 1:
                    self.fail(kind, f"buffer {b.name!r} size {b.size!r} must be a positive int")
                if b.size > MAX_INDEX_ELEMENTS:
                    self.fail(kind, f"buffer {b.name!r} has {b.size:,} elements, over 2^31 - 1: "
                                    "index arithmetic is 32-bit (i32 offsets would wrap to an "
                                    "illegal address); refused, left to XLA")
                self.buffers[b.name] = b
        if k.grid * k.block > MAX_INDEX_ELEMENTS:
            self.fail("launch", f"{k.grid} blocks x {k.block} threads is over 2^31 - 1: thread "
                                "ids are 32-bit; refused, left to XLA")

    # ------------------------------------------------------------ scopes

    @staticmethod
    def _lookup(scopes: list[dict[str, _Var]], name: str) -> _Var | None:
        for frame in reversed(scopes):
            if name in frame:
                return frame[name]
        return None

    def _define(self, scopes: list[dict[str, _Var]], name: str, var: _Var, where: str) -> None:
        if not isinstance(name, str) or not is_identifier(name):
            self.fail(where, f"variable name {name!r} is not an identifier")
        if name in scopes[-1]:
            self.fail(where, f"{name!r} is already defined in this scope")
        scopes[-1][name] = var

    # ------------------------------------------------------------ expressions

    def _expr(self, e: Expr, scopes: list[dict[str, _Var]], where: str) -> bool:
        """Type-check `e`; return whether its value may differ between threads: it reads
        the thread index or a varying variable.

        The checks that need no scope (dtypes, constants, buffers) run once per expression
        object in the whole validation: lowered expressions are DAGs shared between
        statements, and the body is walked until the varying set settles. The variables it
        reads are looked up where it is used."""
        if id(e) not in self._checked:
            self._check_structure(e, where)
        varying = reads_thread_idx(e)
        uniform_locals = []
        for name, dtype in sorted(expr_refs(e)):
            var = self._lookup(scopes, name)
            if var is None:
                self.fail(where, f"undefined variable {name!r}")
            if var.dtype != dtype:
                self.fail(where, f"Ref({name}) has dtype {dtype}, variable is {var.dtype}")
            if var.kind == "local" and not var.varying:
                uniform_locals.append(var.key)
            varying = varying or var.varying
        if not varying or not RELEVANT_READS_ONLY:
            # A Local read as uniform only decided this expression if it came out uniform:
            # where it is varying anyway, the Local turning varying later changes nothing.
            self._read_uniform.update(uniform_locals)
        return varying

    def _check_structure(self, e: Expr, where: str) -> None:
        stack = [e]
        while stack:
            x = stack.pop()
            if id(x) in self._checked:
                continue
            if not isinstance(x, Expr):
                self.fail(where, f"{x!r} is not an expression")
            subs = sub_exprs(x)
            for sub in subs:
                if not isinstance(sub, Expr):
                    self.fail(where, f"{sub!r} is not an expression")
            self._check_node(x, where)
            self._checked[id(x)] = x        # kept alive: ids stay unique
            stack.extend(subs)

    def _check_node(self, e: Expr, where: str) -> None:
        """The scope-free checks of one expression node (its operands are expressions)."""
        if e.dtype not in VALUE_DTYPES:
            self.fail(where, f"{type(e).__name__} has non-value dtype {e.dtype!r}")
        if isinstance(e, Const):
            self._const(e, where)
            return
        if isinstance(e, (Ref, ThreadIdx, BlockIdx, BlockDim, GridDim)):
            return
        if isinstance(e, Load):
            buf = self.buffers.get(e.buffer)
            if buf is None:
                self.fail(where, f"Load from unknown buffer {e.buffer!r}")
            if e.dtype != value_dtype(buf.dtype):
                self.fail(where, f"Load({e.buffer}) dtype {e.dtype} but buffer is {buf.dtype}")
            if e.index.dtype not in INDEX_DTYPES:
                self.fail(where, f"Load({e.buffer}) index has dtype {e.index.dtype}, need i32/i64")
        elif isinstance(e, (Binary, Compare)):
            if e.a.dtype != e.b.dtype:
                self.fail(where, f"{type(e).__name__}({e.op}) operands {e.a.dtype} vs {e.b.dtype}")
            if isinstance(e, Binary) and e.a.dtype not in BINARY_DTYPES[e.op]:
                self.fail(where, f"Binary({e.op}) does not take {e.a.dtype}")
        elif isinstance(e, Unary):
            if e.a.dtype not in UNARY_DTYPES[e.op]:
                self.fail(where, f"Unary({e.op}) does not take {e.a.dtype}")
        elif isinstance(e, Select):
            if e.cond.dtype != "i1":
                self.fail(where, f"Select condition has dtype {e.cond.dtype}, need i1")
            if e.a.dtype != e.b.dtype:
                self.fail(where, f"Select branches {e.a.dtype} vs {e.b.dtype}")
        elif isinstance(e, Bitcast):
            if bitcast_problem(e.a.dtype, e.dtype):
                self.fail(where, f"Bitcast {e.a.dtype} -> {e.dtype}")
        elif not isinstance(e, Convert):
            self.fail(where, f"unknown expression {type(e).__name__}")

    def _const(self, e: Const, where: str) -> None:
        v = e.value
        if e.dtype in FLOAT_DTYPES:
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
        else:
            lo, hi = _INT_RANGES[e.dtype]
            ok = isinstance(v, numbers.Integral) and lo <= int(v) <= hi
        if not ok:
            self.fail(where, f"Const {v!r} does not fit dtype {e.dtype}")

    # ------------------------------------------------------------ statements

    def _body(self, body: tuple[Stmt, ...], scopes: list[dict[str, _Var]],
              divergent: str | None, path: str, frame: dict[str, _Var] | None = None) -> None:
        top = not scopes
        scopes = [*scopes, dict(frame or {})]
        for i, s in enumerate(body):
            if isinstance(s, GridBarrier):
                if not top:
                    self.fail(f"{path}[{i}] GridBarrier", "a grid barrier must be a top-level "
                              "statement of the kernel (uniform across the grid)")
                # No variable crosses a grid barrier: values go through global memory.
                scopes = [{}]
                continue
            self._stmt(s, scopes, divergent, f"{path}[{i}]")

    def _stmt(self, s: Stmt, scopes: list[dict[str, _Var]], divergent: str | None,
              path: str) -> None:
        if not isinstance(s, Stmt):
            self.fail(path, f"{s!r} is not a statement")
        where = f"{path} {_describe(s)}"
        if isinstance(s, Let):
            varying = self._expr(s.expr, scopes, where)
            self._define(scopes, s.name, _Var(s.expr.dtype, "let", varying, id(s)), where)
        elif isinstance(s, Local):
            if s.dtype not in VALUE_DTYPES:
                self.fail(where, f"Local dtype {s.dtype!r} is not a value dtype")
            varying = id(s) in self.varying_locals
            if s.init is not None:
                varying |= self._expr(s.init, scopes, where)
                if s.init.dtype != s.dtype:
                    self.fail(where, f"init has dtype {s.init.dtype}, Local is {s.dtype}")
            self._define(scopes, s.name, _Var(s.dtype, "local", varying, id(s)), where)
        elif isinstance(s, Assign):
            var = self._lookup(scopes, s.name)
            if var is None:
                self.fail(where, f"assignment to undefined variable {s.name!r}")
            if var.kind != "local":
                self.fail(where, f"{s.name!r} is a {var.kind} variable, only Locals are mutable")
            varying = self._expr(s.expr, scopes, where)
            if s.expr.dtype != var.dtype:
                self.fail(where, f"value has dtype {s.expr.dtype}, {s.name!r} is {var.dtype}")
            if (varying or divergent) and not var.varying:
                var.varying = True
                self.varying_locals.add(var.key)
                # Only a read that saw it uniform is stale; later reads see it varying.
                self.changed = self.changed or var.key in self._read_uniform
        elif isinstance(s, Store):
            self._store(s, scopes, where)
        elif isinstance(s, AtomicAdd):
            self._atomic(s, scopes, where)
        elif isinstance(s, For):
            self._for(s, scopes, divergent, path, where)
        elif isinstance(s, If):
            if self._expr(s.cond, scopes, where):
                divergent = divergent or f"{where} (condition depends on threadIdx)"
            if s.cond.dtype != "i1":
                self.fail(where, f"condition has dtype {s.cond.dtype}, need i1")
            self._body(s.then, scopes, divergent, f"{path}.then")
            self._body(s.orelse, scopes, divergent, f"{path}.orelse")
        elif isinstance(s, COLLECTIVES):
            self._collective(s, scopes, divergent, where)
        else:
            self.fail(where, "unknown statement")

    def _store(self, s: Store, scopes: list[dict[str, _Var]], where: str) -> None:
        buf = self.buffers.get(s.buffer)
        if buf is None:
            self.fail(where, f"Store to unknown buffer {s.buffer!r}")
        if isinstance(buf, Param) and not buf.is_output:
            self.fail(where, f"Store to param {s.buffer!r}, which is not marked is_output")
        self._expr(s.index, scopes, where)
        self._expr(s.value, scopes, where)
        if s.index.dtype not in INDEX_DTYPES:
            self.fail(where, f"index has dtype {s.index.dtype}, need i32/i64")
        if s.value.dtype != value_dtype(buf.dtype):
            self.fail(where, f"value has dtype {s.value.dtype}, buffer {buf.name!r} "
                             f"({buf.dtype}) takes {value_dtype(buf.dtype)}")

    def _atomic(self, s: AtomicAdd, scopes: list[dict[str, _Var]], where: str) -> None:
        buf = self.buffers.get(s.buffer)
        if not isinstance(buf, Param) or not buf.is_output:
            self.fail(where, f"AtomicAdd needs an output param, {s.buffer!r} is not one")
        if buf.dtype not in ATOMIC_DTYPES:
            self.fail(where, f"AtomicAdd does not take {buf.dtype} buffers")
        if s.op not in ATOMIC_OPS:
            self.fail(where, f"AtomicAdd op {s.op!r} is not one of {sorted(ATOMIC_OPS)}")
        self._expr(s.index, scopes, where)
        self._expr(s.value, scopes, where)
        if s.index.dtype not in INDEX_DTYPES:
            self.fail(where, f"index has dtype {s.index.dtype}, need i32/i64")
        if s.value.dtype != value_dtype(buf.dtype):
            self.fail(where, f"value has dtype {s.value.dtype}, buffer {buf.name!r} "
                             f"({buf.dtype}) takes {value_dtype(buf.dtype)}")

    def _for(self, s: For, scopes: list[dict[str, _Var]], divergent: str | None, path: str,
             where: str) -> None:
        varying = any([self._expr(e, scopes, where) for e in (s.start, s.stop, s.step)])
        dtypes = {s.start.dtype, s.stop.dtype, s.step.dtype}
        if len(dtypes) != 1 or s.start.dtype not in INDEX_DTYPES:
            self.fail(where, f"start/stop/step dtypes {sorted(dtypes)} must all be i32 or i64")
        if isinstance(s.step, Const) and s.step.value <= 0:
            self.fail(where, f"step {s.step.value} must be positive")
        if varying:
            divergent = divergent or f"{where} (bounds depend on threadIdx)"
        frame = {}
        self._define([frame], s.var, _Var(s.start.dtype, "loop", varying, id(s)), where)
        self._body(s.body, scopes, divergent, f"{path}.body", frame)

    def _collective(self, s: Stmt, scopes: list[dict[str, _Var]], divergent: str | None,
                    where: str) -> None:
        if divergent and self.final:
            self.fail(where, f"block/warp collective in thread-dependent control flow: {divergent}")
        if isinstance(s, WarpShuffle):
            self._expr(s.value, scopes, where)
            self._expr(s.lane, scopes, where)
            if s.lane.dtype != "i32":
                self.fail(where, f"lane has dtype {s.lane.dtype}, need i32")
            self._define(scopes, s.dest, _Var(s.value.dtype, "lane", True, id(s)), where)
        elif isinstance(s, WarpReduce):
            self._expr(s.value, scopes, where)
            if s.value.dtype not in NUMERIC_DTYPES:
                self.fail(where, f"WarpReduce does not take {s.value.dtype}")
            self._define(scopes, s.dest, _Var(s.value.dtype, "lane", True, id(s)), where)
        elif isinstance(s, MmaSync):
            m, n, k = s.shape
            for part, want in s.fragment_sizes.items():
                if len(getattr(s, part)) != want:
                    self.fail(where, f"MmaSync {part} has {len(getattr(s, part))} values, "
                                     f"m{m}n{n}k{k} ({s.dtype}) takes {want}")
            for e in (*s.a, *s.b, *s.c):
                self._expr(e, scopes, where)
                if e.dtype != "f32":
                    self.fail(where, f"MmaSync fragment value has dtype {e.dtype}, need f32")
            for name in s.dest:
                self._define(scopes, name, _Var("f32", "lane", True, id(s)), where)
