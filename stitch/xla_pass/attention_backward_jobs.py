"""The pass's attention-backward kernels: each backward that
``stitch.hlo.attention_backward`` recognizes in XLA's module becomes one two-phase
kernel (``stitch.codegen.attention_backward.lower_attention_backward``) replacing XLA's dP
GEMM, softmax-gradient fusion and dQ / dK / dV GEMMs, reading only Q, K, V and dO: no
kernel of the backward reads or writes a scores-sized buffer any more.

The planner does not plan these kernels (it keeps pricing XLA's instructions); they are
placed next to the plan's GEMM-chain kernels, where no stitched kernel of the plan takes
any of the instructions they replace. Anything that does not fit is left to XLA with the
reason in the report."""
from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

KIND = "attention_backward"


@dataclass(frozen=True)
class BackwardKernel:
    """What the pass's job list needs of a kernel it did not plan."""
    name: str
    members: frozenset[int]
    kind: str = KIND
    schedule: Any = None
    notes: tuple[str, ...] = field(default=())
    cost: Any = None            # its modeled KernelCost (kernel_cost), as delivered


def _top_level_nodes(view: Any) -> dict[str, int]:
    """Each top-level instruction's op-graph node (the first in the graph's order), by
    name: what ``_node_of`` looks up, indexed once per graph."""
    index: dict[str, int] = {}
    for node in view.graph.nodes:
        name = node.instruction.name
        if node.computation == view.comp.name and node.xla_group in (None, name):
            index.setdefault(name, node.id)
    return index


def _node_of(view: Any, name: str, top_level: dict[str, int]) -> int:
    """The op-graph node of top-level instruction ``name`` (``top_level``: the graph's
    ``_top_level_nodes``)."""
    if name in top_level:
        return top_level[name]
    root = view.fused_root(name)        # a fusion's value: its root op
    for nid in view.group_ops.get(name, ()) if root is not None else ():
        if view.graph.nodes[nid].instruction.name == root.name:
            return nid
    raise KeyError(name)


def _past_taken_bitcasts(view: Any, name: str, taken: set[str]) -> str:
    """The instruction the backward reads for operand ``name``: where ``name`` is a
    bitcast another kernel's site takes (a forward chain reading the rotary Q through it),
    the value it bitcasts, read instead (the same bytes: the kernel indexes the flat
    buffer), so that the bitcast goes with that kernel and nothing outside reads it."""
    inst = view.table[name]
    while name in taken and inst.opcode == "bitcast" and len(inst.operands) == 1 and \
            inst.operands[0] in view.table and \
            view.table[inst.operands[0]].shape.element_type == inst.shape.element_type:
        name = inst.operands[0]
        inst = view.table[name]
    return name


# "priced": placed where ``modeled_gain_s`` says the kernel beats what it replaces;
# "always": placed wherever it fits (tests of the placement).
PLACEMENT = "priced"
def kernel_cost(match: Any, spec: Any, tensor_cores: bool) -> Any:
    """The kernel's modeled ``KernelCost``: its work at ``stitch.cost.mma_efficiency``'s
    fraction of the tensor cores' peak (TF32 or half; ``tensor_cores``) or of the f32 peak
    (measured where the GPU kit calibrated the target, else assumed), or
    its operands' and results' bytes, whichever is longer, and two launches. The work: S
    and dP three times (statistics pass, dQ phase, dK/dV phase) per head block of the
    tiling the kernel is built with (each block recomputes them for its slice of the
    results) and the dQ, dK and dV GEMMs, each 2 b m n d flops, over the tiles a causal
    mask leaves (about half)."""
    from stitch.codegen.attention_backward import BackwardTiling, head_blocks, problem_for
    from stitch.pricing.delta import KernelCost
    from stitch.cost.gemm_rates import FP32, peak_flops, precision_class
    from stitch.cost.mma_efficiency import kernel_efficiency
    b, m, n, d = match.batch, match.queries, match.keys, match.head_dim
    share = 0.5 + 32 / (2 * n) if match.causal else 1.0
    problem = problem_for(match)
    blocks = head_blocks(problem, BackwardTiling.default_for(problem, two_results=True,
                                                             mma=tensor_cores))
    flops = (6 * blocks + 3) * 2 * b * m * n * d * share
    width = 2 if match.dtype in ("bf16", "f16") else 4
    moved = width * (2 * b * m * d + 2 * b * n * d + 2 * b * m * d + 2 * b * n * d)
    unit = precision_class(spec, (match.dtype,), match.tf32) if tensor_cores else FP32
    rate = (peak_flops(spec, unit) or spec.fp32_flops) * kernel_efficiency(
        spec.name, unit, "attention_backward")
    compute_s, memory_s = flops / rate, moved / spec.hbm_bandwidth
    return KernelCost(int(moved), 1, memory_s, compute_s, 0,
                      max(compute_s, memory_s) + 2 * spec.kernel_launch_overhead_s)


def planned_saving_s(graph_plan: Any, kernel: Any) -> float:
    """What a planned stitched kernel saves against the baseline kernels it overlaps, as
    the delivery prices a dropped kernel (0 where it is unpriced or saves nothing): lost
    when a backward takes its instructions."""
    from .payback import baseline_kernels
    cost = getattr(kernel, "cost", None)
    if cost is None:
        return 0.0
    replaced = sum(k.cost.total_s for k in baseline_kernels(graph_plan).touching(kernel.members))
    return max(replaced - cost.total_s, 0.0) * graph_plan.stitched.weight


def modeled_gain_s(match: Any, spec: Any, replaced_s: float, tensor_cores: bool) -> float:
    """XLA's time for what the kernel replaces (``replaced_s``: its kernels, priced by
    the plan's baseline, plus the forward's S and P writes the kernel makes unnecessary)
    less the kernel's (``kernel_cost``)."""
    b, m, n = match.batch, match.queries, match.keys
    width = 2 if match.dtype in ("bf16", "f16") else 4
    kernel_s = kernel_cost(match, spec, tensor_cores).total_s
    scores_written = 2 * b * m * n * (4 if match.dtype == "f32" else width) / spec.hbm_bandwidth
    return replaced_s + scores_written - kernel_s


def _with_free_readers(view: Any, replaced: set[str]) -> set[str]:
    """``replaced`` and the bitcasts between them (dS reaches its GEMMs through one)."""
    readers = view.readers()
    grown = True
    while grown:
        grown = False
        for name in list(replaced):
            for r in readers.get(name, []):
                if r not in replaced and view.table[r].opcode == "bitcast" and all(
                        rr in replaced for rr in readers.get(r, [])):
                    replaced.add(r)
                    grown = True
    return replaced


def attention_backward_jobs(request: Any, report: Any, module: Any, view: Any, gi: int,
                            graph_plan: Any, snapped: list, jobs: list, lock: Any,
                            lower_once: Any = None) -> list:
    """(view, kernel, site, lowered) jobs for the graph's attention backwards; the
    instructions of ``snapped`` kernels and of ``jobs`` so far are not taken; ``lock``:
    held while lowering (the pass's LLVM lock); ``lower_once`` (the pass's
    ``LoweringReuse``): identical layers' backwards lowered once."""
    from stitch.codegen.attention_backward import (lower_attention_backward, problem_for,
                                                   uses_tensor_cores)
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.lower import LoweredKernel, kernel_identifier
    from stitch.codegen.site_keys import LoweringChoices
    from stitch.cost import get_spec
    from stitch.hlo.attention_backward import find_attention_backwards
    from stitch.errors import StitchError

    from .hlo_rewrite import NotPlaceable, find_site
    from .payback import baseline_kernels

    if graph_plan.graph.kind != "entry" or request.device != "gpu":
        return []
    try:
        matches = [m for m in find_attention_backwards(module)
                   if m.computation == view.comp.name]
    except Exception:  # noqa: BLE001 - a recognizer bug must not stop the pass
        log.warning("%s: attention backward recognition failed", module.name, exc_info=True)
        return []
    # Planned memory-intensive kernels yield to a backward that wins with their savings
    # counted against it (the caller then drops them: their XLA instructions stay XLA's,
    # as with the LM head's sites); chain and LM-head jobs are kept.
    planned_tops = [(k, {view.top_of(m) for m in k.members}) for k in snapped]
    taken = {t for job in jobs for t in job[2].tops}
    # The graph's nodes per top-level instruction, once (not a scan of the graph per match:
    # 48 layers, 48 matches).
    nodes_of_top: dict[str, list[int]] = {}
    top_level: dict[str, int] = {}
    if matches:
        for n in view.graph.nodes:
            nodes_of_top.setdefault(view.top_of(n.id), []).append(n.id)
        top_level = _top_level_nodes(view)
    baseline = baseline_kernels(graph_plan)
    out = []
    for i, match in enumerate(matches):
        name = f"{view.comp.name}.attention_backward{i}"
        replaced = _with_free_readers(view, set(match.replaced))
        members = frozenset(v for top in replaced for v in nodes_of_top.get(top, ()))
        try:
            site = find_site(view, gi, name, members)
            shared = sorted(taken & set(site.tops))
            if shared:
                raise NotPlaceable(f"shares XLA instructions ({', '.join(shared[:3])}) with "
                                   f"another stitched kernel")
            inputs = [_node_of(view, _past_taken_bitcasts(view, v, taken), top_level)
                      for v in (match.q, match.k, match.v, match.d_o)]
            outputs = [_node_of(view, v, top_level) for v in (match.dq, match.dk, match.dv)]
        except (NotPlaceable, KeyError) as exc:
            report.skipped.append((name, f"attention backward: {exc}"))
            continue
        replaced_s = sum(k.cost.total_s for k in baseline.touching(members))
        problem = problem_for(match)
        arch = request.gpu_arch()
        tensor_cores = uses_tensor_cores(problem, arch, match.tf32)
        spec = get_spec(request.target)
        yielding = [k for k, tops in planned_tops if tops & set(site.tops)]
        lost_s = sum(planned_saving_s(graph_plan, k) for k in yielding)
        gain_s = modeled_gain_s(match, spec, replaced_s, tensor_cores) - lost_s
        if PLACEMENT != "always" and gain_s <= 0:
            report.skipped.append((name, f"attention backward: modeled {-gain_s * 1e6:.0f} "
                                   f"µs slower than XLA's kernels"
                                   f"{'' if tensor_cores else ' (f32 FMA)'}"
                                   + (f" (with the {lost_s * 1e6:.1f} µs of the planned "
                                      f"kernels it takes from)" if yielding else "")))
            continue
        request.check_cancelled()
        note = (f"attention backward {match.batch}x{match.queries}x{match.keys}x"
                f"{match.head_dim} ({'causal' if match.causal else 'full'}, {match.dtype}"
                f"{', tensor cores' if tensor_cores else ''}, modeled gain "
                f"{gain_s * 1e6:.0f} µs): "
                f"replaces {', '.join(match.replaced)}")

        def lower(problem: Any = problem, name: str = name, inputs: list = inputs,
                  outputs: list = outputs, note: str = note, tf32: bool = match.tf32) -> Any:
            kernel = lower_attention_backward(problem, name=kernel_identifier(name),
                                              arch=arch, allow_tf32=tf32)
            return LoweredKernel(kernel, inputs, outputs, [KIND], [note])
        try:
            with lock:
                lowered = lower() if lower_once is None else lower_once(
                    view.graph, members,
                    LoweringChoices(KIND, None, (arch, match.tf32, PLACEMENT),
                                    tuple(inputs + outputs)), name, lower)
        except (CodegenError, StitchError) as exc:
            log.info("kernel %s stays with XLA: %s", name, exc)
            report.fallbacks.append((name, f"{type(exc).__name__}: {exc}"))
            continue
        # The note names top-level instructions, which a bound lowering cannot rename.
        lowered = dataclasses.replace(lowered, notes=[note])
        taken |= set(site.tops)
        out.append((view, BackwardKernel(name, members, notes=(note,),
                                         cost=kernel_cost(match, spec, tensor_cores)),
                    site, lowered))
        log.info("%s: %s", name, note)
    return out


def _readers_through_bitcasts(view: Any, name: str) -> set[str]:
    readers = view.readers()
    out: set[str] = set()
    for r in readers.get(name, []):
        out |= _readers_through_bitcasts(view, r) if view.table[r].opcode == "bitcast" \
            else {r}
    return out


def without_backward_reads(request: Any, report: Any, chain_jobs: list, backward_jobs: list,
                           lock: Any, spec: Any, tf32: bool, grid_sync: bool,
                           lower_once: Any = None) -> list[tuple[tuple, Any]]:
    """(job, price) for each chain job, each forward chain lowered anew without the values
    (S, the row sums, P) only the replaced backward read: with the backward kernels placed,
    no kernel writes a scores-sized buffer. A chain that cannot be lowered so keeps its job.
    The price (``trimmed_cost``) only for a chain lowered anew: the others are as planned."""
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.site_keys import LoweringChoices
    from stitch.schedule.chain_tiling import lower_planned_chain
    from stitch.errors import StitchError
    from stitch.hlo.gemm_chains import chain_of

    gone = {t for job in backward_jobs for t in job[2].tops}
    if not gone:
        return [(job, None) for job in chain_jobs]
    out: list[tuple[tuple, Any]] = []
    for job in chain_jobs:
        view, k, site, lowered = job
        chain = chain_of(view.graph, tuple(k.members))
        if chain is None or not chain.extra_outputs:
            out.append((job, None))
            continue
        inside = gone | set(site.tops)
        kept = tuple(e for e in chain.extra_outputs
                     if not _readers_through_bitcasts(view, view.top_of(e.node)) <= inside)
        if len(kept) == len(chain.extra_outputs):
            out.append((job, None))
            continue
        fewer = dataclasses.replace(chain, extra_outputs=kept)
        arch = request.gpu_arch() if request.device == "gpu" else "sm_70"
        fma = request.device != "gpu"

        def lower(k: Any = k, fewer: Any = fewer) -> Any:
            return lower_planned_chain(view.graph, k, arch, fma=fma, chain=fewer)
        try:
            with lock:
                trimmed = lower() if lower_once is None else lower_once(
                    view.graph, frozenset(k.members),
                    LoweringChoices("gemm_chain", k.chain_schedule, (arch, fma),
                                    tuple(sorted(e.node for e in kept))) if kept else
                    LoweringChoices("gemm_chain_result_only", k.chain_schedule, (arch, fma)),
                    k.name, lower)
        except (CodegenError, StitchError) as exc:
            log.info("kernel %s keeps the values the backward read: %s", k.name, exc)
            out.append((job, None))
            continue
        log.info("kernel %s: %d of %d extra values no longer written (only the attention "
                 "backward read them)", k.name, len(chain.extra_outputs) - len(kept),
                 len(chain.extra_outputs))
        out.append(((view, k, site, trimmed),
                    trimmed_cost(view.graph, k, chain, fewer, spec, tf32, grid_sync)))
    return out


def trimmed_cost(graph: Any, k: Any, chain: Any, fewer: Any, spec: Any, tf32: bool,
                 grid_sync: bool) -> Any:
    """The planned chain kernel ``k`` built as ``fewer`` (``chain`` with fewer extra
    outputs): its planned schedule priced on the smaller chain's dims (no row pass where P
    is no longer written), less the HBM bytes of the values it no longer writes; None
    (priced as planned) where the kernel has no planned schedule or that schedule cannot
    launch on the smaller chain."""
    from stitch.pricing.chain_pricing import chain_dims, extra_output_bytes
    from stitch.pricing.delta import tile_kernel_cost
    from stitch.cost.gemm_tile import chain_cost

    schedule = getattr(k, "chain_schedule", None)
    if schedule is None or getattr(k, "cost", None) is None:
        return None
    tile = chain_cost(spec, chain_dims(graph, fewer, tf32, grid_sync), schedule)
    if tile.bound == "cannot launch":
        return None
    dropped = extra_output_bytes(chain) - extra_output_bytes(fewer)
    return tile_kernel_cost(spec, tile, max(int(k.cost.hbm_bytes - dropped), 0))
