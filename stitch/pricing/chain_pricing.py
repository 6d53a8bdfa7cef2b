"""GEMM chains of an op graph priced for the planner: the chain kernel at its best
schedule (``gemm_tile.chain_cost`` after the Markov-guided search), and the chain's GEMMs as
XLA runs them (``gemm_tile.gemm_cost`` with the Triton tile of the fusion's backend config;
cuBLAS calls and plain dots an assumed library tile). The delta cost model asks here for a
member set holding a GEMM, so one model prices a chain and the kernels it replaces.

Chains are recognized once per graph (``stitch.hlo.gemm_chains.find_gemm_chains``), and
each chain's search result is cached per chain dims and target (``best_schedule``).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterator

from stitch.hlo.gemm_chains import (GemmChain, find_gemm_chains, needs_row_pass,
                                           softmax_parts)
from stitch.hlo.gemm_chains import allows_tf32 as dot_allows_tf32
from stitch.hlo.graph import OpGraph, OpNode
from stitch.hlo.op_classes import OpClass

from ..cost.gemm_tile import (OPERAND_BYTES, ChainDims, GemmChainSchedule, TileCost, gemm_cost,
                              xla_gemm_tile)
from ..cost.gemm_rates import gemm_dot
from ..cost.gpu_specs import GpuSpec
from ..cost.instruction_costs import EXPENSIVE_INSTRUCTIONS

log = logging.getLogger(__name__)

# Thread instructions per element of ops between the GEMMs (delta.py's classes: light 1,
# expensive by opcode), without the softmax's own ops, which the chain model counts.
_LIGHT_INSTRUCTIONS = 1.0
_SOFTMAX_OPS = frozenset({"reduce", "subtract", "exponential", "divide", "broadcast"})


@dataclass(frozen=True)
class GraphChains:
    chains: tuple[GemmChain, ...]
    by_members: dict            # frozenset(core members) -> chain
    by_gemm: dict               # GEMM node id -> chain


_CHAINS: "weakref.WeakKeyDictionary[OpGraph, GraphChains]" = weakref.WeakKeyDictionary()


def _core(graph: OpGraph, members) -> frozenset[int]:
    return frozenset(v for v in members if not graph.is_free(v))


def graph_chains(graph: OpGraph) -> GraphChains:
    """The graph's chains, recognized once (a recognizer error means no chains, logged)."""
    got = _CHAINS.get(graph)
    if got is None:
        try:
            chains = tuple(find_gemm_chains(graph))
        except Exception:  # noqa: BLE001 - a recognizer bug must not stop planning
            log.warning("graph %s: GEMM chain recognition failed", graph.name, exc_info=True)
            chains = ()
        got = _CHAINS[graph] = GraphChains(
            chains, {_core(graph, c.members): c for c in chains},
            {g: c for c in chains for g in (c.first, c.second)})
    return got


def chain_for(graph: OpGraph, members) -> GemmChain | None:
    """The chain exactly these members form (free nodes aside), else None."""
    if sum(graph.nodes[v].op_class is OpClass.COMPUTE for v in members) != 2:
        return None
    return graph_chains(graph).by_members.get(_core(graph, members))


def allows_tf32(graph: OpGraph, node: OpNode) -> bool:
    """An f32 GEMM node (a dot, a GEMM fusion, a cuBLAS call) may run on TF32 tensor cores:
    the recognizer's rule (``stitch.hlo.gemm_chains.allows_tf32``) on its dot."""
    inst, _operands = gemm_dot(graph, node)
    return inst is None or dot_allows_tf32(inst)


def _between_instructions(graph: OpGraph, chain: GemmChain) -> float:
    total = 0.0
    for v in chain.between:
        node = graph.nodes[v]
        if graph.is_free(v) or node.op_class is OpClass.SOURCE:
            continue
        if chain.softmax and node.opcode in _SOFTMAX_OPS:
            continue
        if node.op_class is OpClass.EXPENSIVE:
            total += EXPENSIVE_INSTRUCTIONS.get(node.opcode, 10.0)
        elif node.op_class in (OpClass.LIGHT, OpClass.LAYOUT):
            total += _LIGHT_INSTRUCTIONS
    return total


def _input_bytes(chain: GemmChain) -> float:
    """HBM bytes of the values the chain program reads besides the GEMM operands: the
    distinct elements of each view (a stride of 0 broadcasts along that dim)."""
    total = 0.0
    for op in chain.program:
        if op.kind != "input" or op.view is None:
            continue
        v = op.view
        elements = (chain.batch if v.batch_stride else 1) * (chain.m if v.row_stride else 1)
        if op.rank == "tile":
            elements *= chain.n if v.col_stride else 1
        total += elements * OPERAND_BYTES.get(op.dtype, 4)
    return total


def extra_output_bytes(chain: GemmChain) -> float:
    """HBM bytes of the values the chain kernel also writes (``GemmChain.extra_outputs``)."""
    per_row = {"tile": chain.n, "row": 1}
    return float(sum(chain.batch * chain.m * per_row[out.rank] * OPERAND_BYTES.get(out.dtype, 4)
                     for out in chain.extra_outputs))


def chain_dims(graph: OpGraph, chain: GemmChain, tf32: bool = False,
               grid_sync: bool = False) -> ChainDims:
    """``tf32``: the chain kernel may use TF32 tensor cores where its dots allow them (the
    GPU compile paths; host paths compute f32 exactly, as XLA CPU does). ``grid_sync``: the
    target runs grid-barrier kernels, so the schedule may split n across blocks."""
    return ChainDims(chain.batch, chain.m, chain.n, chain.k, chain.h, chain.operand_dtype,
                     chain.softmax, _between_instructions(graph, chain),
                     tf32 and chain.tf32,     # the recognizer's rule, as codegen checks it
                     OPERAND_BYTES.get(chain.output_dtype, 4), _input_bytes(chain),
                     # Values written out need all of n in one warp and block (codegen).
                     bool(chain.extra_outputs) or softmax_parts(chain.program) is None
                     and any(op.kind == "reduce" for op in chain.program), grid_sync,
                     extra_output_bytes(chain), needs_row_pass(chain) and softmax_parts(
                         chain.program, through_convert=True) is not None)


@dataclass(frozen=True)
class ChainPrice:
    chain: GemmChain
    dims: ChainDims
    schedule: GemmChainSchedule
    cost: TileCost
    search_seconds: float
    evaluated: int


_PRICES: dict[tuple, ChainPrice] = {}
# Schedules ptxas spills are struck and the search settles again, at most this many times.
SPILL_RETRIES = 4


_CACHE: list = []


def _compile_cache():
    """The process's on-disk compile cache (stitch.codegen.cache; an unusable directory turns
    caching off there, logged)."""
    if not _CACHE:
        from stitch.codegen.cache import CompileCache
        _CACHE.append(CompileCache())
    return _CACHE[0]


def spill_bytes(graph: OpGraph, chain: GemmChain, schedule: GemmChainSchedule,
                spec: GpuSpec, worker: Any = None) -> int | None:
    """ptxas's spill bytes (stores + loads) of the kernel codegen builds for ``schedule`` on
    ``spec``'s arch; None where there is no ptxas or no build (nothing to judge by).
    ``worker``: an ``IsolatedWorker`` whose running child emits the PTX (else a fresh
    isolated child: an interpreter, llvmlite and the NVPTX target started for one kernel)."""
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.gemm_chain import lower_gemm_chain
    from stitch.codegen.gpu_cache import CANONICAL_NAME, assemble_cached, emit_ptx_cached
    from stitch.codegen.toolchain import find_ptxas

    from ..schedule.chain_tiling import tiling_for
    major, minor = spec.compute_capability
    arch = f"sm_{major}{minor}"
    try:
        find_ptxas(arch)
        kernel = lower_gemm_chain(graph, chain, tiling_for(schedule, chain.h),
                                  CANONICAL_NAME, arch).kernel
        # Emitted in an isolated child (an LLVM abort must not take the planning process
        # down), through the on-disk compile cache: a restarted job or another process
        # planning the same chain does not emit and assemble it again.
        cache = _compile_cache()
        ptx = emit_ptx_cached(kernel, arch, cache=cache, worker=worker).ptx
        report = assemble_cached(ptx, arch, cache=cache,
                                 kernel_name=CANONICAL_NAME).reports[CANONICAL_NAME]
    except (CodegenError, OSError) as exc:
        log.debug("chain %s: no ptxas check of %s (%s)", chain.first, schedule.text(), exc)
        return None
    return report.spill_store_bytes + report.spill_load_bytes


def _searched_price(graph: OpGraph, chain: GemmChain, spec: GpuSpec, dims: ChainDims,
                    method: str, check_spills: bool, worker: Any = None,
                    searched: Future | None = None) -> ChainPrice:
    """The chain's price at the best schedule the search finds, spilling ones struck where
    ``check_spills`` (``chain_price``). ``searched`` gets the search's own result (before
    any spill check) as soon as it is there."""
    from ..schedule.chain_tiling import tiling_for
    from ..schedule.gemm_chain_space import best_schedule
    found = best_schedule(spec, dims, method)
    if searched is not None:
        searched.set_result(found)
    if check_spills:
        rejected: set[GemmChainSchedule] = set()
        for _ in range(SPILL_RETRIES):
            spilled = spill_bytes(graph, chain, found.schedule, spec, worker=worker)
            if not spilled:
                break
            log.info("chain on %s: ptxas spills %d B at %s; settling again", spec.name,
                     spilled, found.schedule.text())
            # Every costed schedule codegen builds as this one (stages and the A
            # hoisting are not carried over) is the same kernel.
            tiling = tiling_for(found.schedule, chain.h)
            rejected.update(x for x in (found.costed or {})
                            if tiling_for(x, chain.h) == tiling)
            rejected.add(found.schedule)
            try:
                found = found.without(spec, dims, frozenset(rejected))
            except ValueError:
                break
    return ChainPrice(chain, dims, found.schedule, found.cost, found.seconds,
                      found.evaluated)


@dataclass(frozen=True)
class _Check:
    """A chain's price being computed in the background (``start_spill_checks``)."""
    searched: Future        # the search's result, before the spill check
    priced: Future          # the ChainPrice, spill check done


# Prices being searched and checked in the background, by chain_price's key: chain_price
# waits for one instead of searching and building it again.
_PENDING: dict[tuple, _Check] = {}
_PENDING_LOCK = threading.Lock()
# Per thread: the guesses chain_price made inside ``speculating`` (None outside it).
_SPECULATION = threading.local()


def start_spill_checks(graph: OpGraph, spec: GpuSpec, method: str = "markov",
                       tf32: bool = False, grid_sync: bool = False,
                       worker: Any = None) -> int:
    """Start pricing each chain of ``graph`` with the ptxas spill check (``chain_price``
    with ``check_spills``) in a background thread, so that the checks' PTX builds and ptxas
    runs (mostly waits on a child) overlap the planner's own work; ``worker`` emits the PTX
    (``spill_bytes``). The result is the one ``chain_price`` computes itself, errors
    included (raised where it asks). Returns how many prices were started (those priced or
    started before are not)."""
    jobs: list[tuple[tuple, _Check, tuple]] = []
    with _PENDING_LOCK:
        for chain in graph_chains(graph).chains:
            dims = chain_dims(graph, chain, tf32, grid_sync)
            key = (dims.key, spec.name, method, True)
            if key in _PRICES or key in _PENDING:
                continue
            check = _PENDING[key] = _Check(Future(), Future())
            jobs.append((key, check, (graph, chain, spec, dims, method, True, worker)))
    if jobs:
        threading.Thread(target=_run_spill_checks, args=(jobs,), daemon=True,
                         name="stitch-chain-spill-checks").start()
    return len(jobs)


def _run_spill_checks(jobs: list[tuple[tuple, _Check, tuple]]) -> None:
    for key, check, args in jobs:
        try:
            price = _searched_price(*args, searched=check.searched)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for the price
            if not check.searched.done():
                check.searched.set_exception(exc)
            check.priced.set_exception(exc)
        else:
            with _PENDING_LOCK:
                _PRICES[key] = price
            check.priced.set_result(price)
        with _PENDING_LOCK:
            _PENDING.pop(key, None)


@contextlib.contextmanager
def speculating() -> Iterator[list[tuple[_Check, ChainPrice]]]:
    """Within it (this thread), ``chain_price`` answers a price whose spill check is still
    running with the searched schedule's price, as if ptxas found no spill, instead of
    waiting; the list gets each guess. ``guesses_held`` then says whether every guess was
    the checked price (else whatever was decided with them must be decided again)."""
    outer = getattr(_SPECULATION, "guesses", None)
    guesses: list[tuple[_Check, ChainPrice]] = []
    _SPECULATION.guesses = guesses
    try:
        yield guesses
    finally:
        _SPECULATION.guesses = outer


def guesses_done(guesses: list[tuple[_Check, ChainPrice]]) -> bool:
    """Whether every check behind ``guesses`` has finished (``guesses_held`` waits for none)."""
    return all(check.priced.done() for check, _ in guesses)


def guesses_held(guesses: list[tuple[_Check, ChainPrice]]) -> bool:
    """Whether each guess ``speculating`` let chain_price make is the price the spill check
    settled on (waits for the checks; a check that failed did not hold)."""
    for check, guess in guesses:
        try:
            checked = check.priced.result()
        except Exception:  # noqa: BLE001 - asked again without guessing, it raises there
            return False
        if (checked.schedule, checked.cost) != (guess.schedule, guess.cost):
            return False
    return True


def chain_price(graph: OpGraph, chain: GemmChain, spec: GpuSpec,
                method: str = "markov", tf32: bool = False,
                check_spills: bool = False, grid_sync: bool = False) -> ChainPrice:
    """The chain kernel at the best schedule the search finds (cached per dims/target);
    ``tf32`` and ``grid_sync`` (n split across blocks allowed) as in ``chain_dims``. ``check_spills``: where ptxas is installed, the chosen
    schedule is built and assembled for the target's arch, and a schedule ptxas spills is
    struck and the search settles on the next (the register model cannot see ptxas's own
    heuristics: it spilled 16-96 bytes at 64-255 registers on schedules the model puts well
    inside the register file). A price ``start_spill_checks`` is computing is waited for,
    or, inside ``speculating``, guessed."""
    dims = chain_dims(graph, chain, tf32, grid_sync)
    key = (dims.key, spec.name, method, check_spills)
    with _PENDING_LOCK:
        got = _PRICES.get(key)
        pending = _PENDING.get(key) if got is None else None
    if got is None and pending is not None:
        guesses = getattr(_SPECULATION, "guesses", None)
        if guesses is not None and not pending.priced.done():
            found = pending.searched.result()       # raises as the search does
            guess = ChainPrice(chain, dims, found.schedule, found.cost, found.seconds,
                               found.evaluated)
            guesses.append((pending, guess))
            return guess
        got = pending.priced.result()
    if got is None:
        got = _PRICES[key] = _searched_price(graph, chain, spec, dims, method, check_spills)
    return ChainPrice(chain, got.dims, got.schedule, got.cost, got.search_seconds,
                      got.evaluated)


def _leaf_elements(node: OpNode) -> int:
    shape = node.shape
    if shape.is_tuple:
        return max((s.num_elements for s in shape.leaves() if s.is_array), default=1)
    return max(shape.num_elements, 1)


def xla_gemm_cost(graph: OpGraph, nid: int, spec: GpuSpec, tile=None) -> TileCost | None:
    """A chain GEMM (first or second) as XLA runs it alone, tiled as its backend config
    says (or ``tile``); None for GEMMs in no chain. A split second GEMM computes its
    splits as batch (the split-K reduce is a kernel of its own)."""
    chain = graph_chains(graph).by_gemm.get(nid)
    if chain is None:
        return None
    node = graph.nodes[nid]
    tile = tile or xla_gemm_tile(node.instruction.backend_config)
    tf32 = allows_tf32(graph, node)
    if nid == chain.first:
        return gemm_cost(spec, chain.batch, chain.m, chain.n, chain.k, tile,
                         chain.operand_dtype, tf32, 4)
    split = max(_leaf_elements(node) // max(chain.batch * chain.m * chain.h, 1), 1)
    return gemm_cost(spec, chain.batch * split, chain.m, chain.h, max(chain.n // split, 1),
                     tile, chain.operand_dtype, tf32,
                     4 if split > 1 else OPERAND_BYTES.get(chain.output_dtype, 4))
