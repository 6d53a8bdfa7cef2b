"""Kernel IR: a small structured SIMT language that both code generators (host, NVPTX) consume.

A `Kernel` is the body one GPU thread runs, with a 1-D grid of 1-D blocks. Expressions are
immutable and typed at construction (`dtype` on every node); statements are structured
(no goto / break / return), so every Let dominates the rest of its scope. `Kernel.validate()`
checks names, types, buffers and that block collectives sit in uniform control flow.

Value dtypes (what expressions compute in): f32 f64 i1 i8 i32 i64 u8 u32. Storage dtypes
add f16 and bf16, which only appear as buffer element types: a Load of an f16/bf16 buffer
yields f32 and a Store into one takes f32 (converted at the edge, round to nearest even).

Modules: ``nodes`` (dtypes, buffers, expressions, statements, walks), ``kernel``
(``Kernel``), ``check`` (``KernelChecker``). Everything public is re-exported here.
"""
from .check import CheckedKernel, KernelChecker
from .kernel import Kernel, has_atomics, has_grid_barrier, launches
from .nodes import (add, as_tuple, Assign, ATOMIC_DTYPES, ATOMIC_OPS, AtomicAdd, Barrier, Binary,
                    BINARY_DTYPES, BINARY_OPS, Bitcast, bitcast_problem, BITCAST_WIDTHS, BlockDim,
                    BlockIdx, Buffer, child_bodies, COLLECTIVES, Compare, COMPARE_OPS, Const,
                    const, Convert, Expr, expr_refs, f32, FLOAT_DTYPES, For, GlobalScratch,
                    grid_phases, GRID_SYNC_MODES, GridBarrier, GridDim, has_collective, i32, i64,
                    If, INDEX_DTYPES, INT_DTYPES, is_identifier, less, Let, Load, load, Local,
                    logical_and, MAX_INDEX_ELEMENTS, minimum, MMA_DTYPES, MMA_SHAPES, MmaSync, mul,
                    multiple_of, NUMERIC_DTYPES, Param, reads_thread_idx, REDUCE_OPS, Ref, ref,
                    Select, Shared, SHUFFLE_MODES, SIGNED_DTYPES, Stmt, STORAGE_DTYPES, Store,
                    sub_exprs, ThreadIdx, Unary, UNARY_DTYPES, UNARY_OPS, UNSIGNED_DTYPES,
                    value_dtype, VALUE_DTYPES, walk_stmts, WarpReduce, WarpShuffle)

__all__ = ["add", "as_tuple", "Assign", "ATOMIC_DTYPES", "ATOMIC_OPS", "AtomicAdd", "Barrier",
           "Binary", "BINARY_DTYPES", "BINARY_OPS", "Bitcast", "bitcast_problem",
           "BITCAST_WIDTHS", "BlockDim", "BlockIdx", "Buffer", "CheckedKernel",
           "child_bodies", "COLLECTIVES", "Compare", "COMPARE_OPS", "Const", "const",
           "Convert", "Expr", "expr_refs", "f32", "FLOAT_DTYPES", "For",
           "GlobalScratch", "grid_phases", "GRID_SYNC_MODES", "GridBarrier", "GridDim",
           "has_atomics", "has_collective", "has_grid_barrier", "i32", "i64", "If",
           "INDEX_DTYPES", "INT_DTYPES", "is_identifier", "Kernel", "KernelChecker",
           "launches", "less", "Let", "Load", "load", "Local", "logical_and",
           "MAX_INDEX_ELEMENTS", "minimum", "MMA_DTYPES", "MMA_SHAPES", "MmaSync",
           "mul", "multiple_of", "NUMERIC_DTYPES", "Param", "reads_thread_idx",
           "REDUCE_OPS", "Ref", "ref", "Select", "Shared", "SHUFFLE_MODES",
           "SIGNED_DTYPES", "Stmt", "STORAGE_DTYPES", "Store", "sub_exprs", "ThreadIdx",
           "Unary", "UNARY_DTYPES", "UNARY_OPS", "UNSIGNED_DTYPES", "value_dtype",
           "VALUE_DTYPES", "walk_stmts", "WarpReduce", "WarpShuffle"]
