"""GEMM chains: two GEMMs whose second contracts over the first one's result columns, with
only memory-intensive work between them (MCFuser's memory-bound chains, attention).

A chain computes, per batch b (heads x batch)::

    S[b, m, n] = sum_k A[b, m, k] * B[b, k, n]          (the first GEMM)
    P[b, m, n] = program(S)[b, m, n]                     (scale, mask, softmax, ...)
    O[b, m, h] = sum_n P[b, m, n] * C[b, n, h]           (the second GEMM)

The score matrix S/P never needs to reach memory: a chain kernel (stitch.codegen.gemm_chain)
streams over n. Recognition works on ``OpGraph``s as XLA leaves them: GEMMs are plain
``dot``s, GEMM fusions kept as one COMPUTE node (their computation may hold a scale
epilogue after the dot, or an elementwise prologue in front of the second GEMM's lhs) or
cuBLAS custom calls (alpha scales, beta must be 0). XLA splits a long contraction into a
batch dim of the GEMM and a reduce over it afterwards (split-K, ``[512,4,64] x [4,64,64]``
then a reduce over dim 0): that reduce is part of the GEMM it finishes.

Everything between the GEMMs becomes ``GemmChain.program``: a hash-consed list of element
ops over three ranks of value, "tile" (one per (b, m, n)), "row" (one per (b, m)) and
"scalar". A value's rank is read off its element count, so every value must be row-major
(bitcast-compatible with the canonical [B, M, N] / [B, M] layouts): bitcasts, row-major
reshapes and copies only rename, broadcasts must spread rows along n (or scalars), and
reductions must reduce over exactly n. Anything else is not a chain (logged at debug).
"""
from __future__ import annotations

import logging
import weakref

from .gemm_chain_operands import allows_tf32
from .gemm_chain_program import (ELEMENTWISE_OPS, GEMM_DTYPES, REDUCERS, ChainOp, ChainOutput,
                                 GemmChain, NotAChain, OperandView, SoftmaxParts,
                                 needs_row_pass, softmax_parts)
from .gemm_chain_recognizer import Recognizer
from .gemm_chain_search import ChainSearch
from .graph import OpGraph
from .op_classes import OpClass

__all__ = ["ELEMENTWISE_OPS", "GEMM_DTYPES", "REDUCERS", "ChainOp", "ChainOutput", "GemmChain",
           "OperandView", "SoftmaxParts", "allows_tf32", "chain_of", "find_gemm_chains",
           "needs_row_pass", "softmax_parts"]

log = logging.getLogger(__name__)


def find_gemm_chains(graph: OpGraph) -> list[GemmChain]:
    """Every chain of ``graph``, in topological order of their first GEMM; a GEMM belongs
    to at most one chain (the earlier one wins). Cached per graph (graphs are not changed
    after they are built; the planner and the lowering ask many times)."""
    key = len(graph.nodes)
    cached = _FOUND.get(graph)
    if cached is None or cached[0] != key:
        cached = (key, tuple(_find(graph)))
        _FOUND[graph] = cached
    return list(cached[1])


_FOUND: "weakref.WeakKeyDictionary[OpGraph, tuple[int, tuple[GemmChain, ...]]]" = \
    weakref.WeakKeyDictionary()



def _find(graph: OpGraph) -> list[GemmChain]:
    chains: list[GemmChain] = []
    taken: set[int] = set()
    reach = ChainSearch.of(graph)
    for node in graph.nodes:
        if node.op_class is not OpClass.COMPUTE or node.id in taken:
            continue
        for second in reach.second_candidates(graph, node.id):
            if second in taken:
                continue
            try:
                chain = Recognizer(graph, node.id, second, reach).run()
            except NotAChain as why:
                log.debug("%s: %s -> %s is not a GEMM chain: %s", graph.name, node.name,
                          graph.nodes[second].name, why)
                continue
            except (KeyError, ValueError, IndexError, TypeError, ZeroDivisionError) as exc:
                # An HLO form the recognizer does not expect (odd attributes or configs):
                # no chain, never a failed plan.
                log.warning("%s: %s -> %s: GEMM chain recognition failed (%s: %s); "
                            "treated as no chain", graph.name, node.name,
                            graph.nodes[second].name, type(exc).__name__, exc)
                continue
            if taken & set(chain.members):
                log.debug("%s: chain %s -> %s overlaps an earlier chain", graph.name,
                          node.name, graph.nodes[second].name)
                continue
            chains.append(chain)
            taken.update(chain.members)
            break
    return chains


def chain_of(graph: OpGraph, members: tuple[int, ...]) -> GemmChain | None:
    """The chain if exactly these members form one (what the planner and lowering ask).
    Free nodes (bitcasts) and constants may be left out of ``members`` or added."""
    wanted = set(members)
    for chain in find_gemm_chains(graph):
        if set(chain.members) == wanted:
            return chain
        if _core(graph, chain.members) == _core(graph, wanted):
            return chain
    return None


def _core(graph: OpGraph, ids) -> set[int]:
    return {i for i in ids if not graph.is_free(i)}
