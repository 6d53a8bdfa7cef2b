"""The explorer's options (``ExplorerOptions``): what the planner searches, how it picks among
candidate plans, and which kernel forms the target builds."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class ExplorerOptions:
    top_k: int = 3
    beam_width: int = 3
    group_size: int = 2
    remote_fusion: bool = True
    packing: bool = True
    lookahead_beam: bool = True
    schedules: bool = True          # tune a stitching schedule for every stitched kernel
    # Final choice among the candidate plans: "latency" = the latency-evaluator over each
    # plan's tuned schedules (§4.3; needs schedules), "delta" = the delta cost model. The
    # default stays "delta" until the two models agree: on dien_train they still differ
    # by up to 3x on packed and column-reduction kernels (see docs/benchmarks.md).
    final_pick: str = "delta"
    recompute: bool = True          # refine each plan by split/recomputation moves
    blp_time_limit_s: float = 30.0
    # Candidate kernels of two GEMMs with the memory-intensive ops between them
    # (stitch.hlo.gemm_chains; kind "gemm_chain"), priced by stitch.cost.gemm_tile at the
    # schedule the Markov-guided search finds. The compile paths turn them off until
    # codegen lowers them.
    gemm_chains: bool = True
    # f32 chain kernels may use TF32 tensor cores where the dots allow them (DEFAULT
    # precision: what XLA GPU does for them too). The GPU compile path turns it on; host
    # paths keep f32 exact, as XLA CPU computes it.
    chain_tf32: bool = False
    # Build each chosen chain schedule and assemble it with ptxas (when installed), striking
    # schedules ptxas spills (chain_pricing.chain_price): a second or so per distinct chain.
    # The GPU compile path turns it on; host paths never run the PTX.
    chain_spill_check: bool = False
    # Chain schedules may split n across blocks (a grid barrier before the cross-block
    # combine): only where the target runs grid-barrier kernels (STITCH_GRID_SYNC on GPU).
    chain_grid_sync: bool = False
    # The global-scope (grid barrier) launch forms the target builds, as
    # stitch.cost.launch_forms names them: "off" (none: a pattern only the global scope
    # stitches is no kernel), "relaunch", "barrier" or "auto"; the cost model prices a
    # global-scope pattern in the form it will be built in. The host runs every form
    # ("barrier", the persistent kernel's price); the GPU pass passes STITCH_GRID_SYNC.
    grid_sync: str = "barrier"
    # Ops per explored pattern (None: MAX_PATTERN_OPS on graphs of at most
    # SMALL_GRAPH_OPS ops, LARGE_GRAPH_PATTERN_OPS above). Scoring a pattern costs time
    # linear in its size and a long chain makes every vertex's patterns that large, so
    # planning grew quadratically; kernels still grow past the bound by merging adjacent
    # kernels (refinement and packing, up to MAX_PATTERN_OPS).
    max_pattern_ops: int | None = None
    # Share kernel costs and feasibility verdicts between member sets of the same structure
    # (repeated layers; stitch.pricing.structure). Off only to check it changes no plan.
    share_structure: bool = True
    # Plan an XLA-optimized graph with XLA's instructions as the explorer's vertices (a
    # fusion stays whole: every candidate pattern is a union of XLA's kernels) and no
    # op-level refinement. The XLA pass sets it: its kernels are snapped to whole
    # instructions anyway (stitch.xla_pass.snap), and the graph it plans is ~10x smaller in
    # units than in ops (docs/benchmarks.md, bench-xla-units).
    xla_units: bool = False
    # Returns True once planning should stop: polled every ~50 ms of planning work, it
    # makes stitch.plan raise PlanCancelled (stitch.explorer.cancel). Not part of the
    # plan cache key.
    cancel: Callable[[], bool] | None = field(default=None, compare=False)
    # An ``IsolatedWorker`` (stitch.codegen.isolation) whose running child emits the PTX of
    # the chain spill checks (chain_spill_check), which then start as planning begins and
    # run beside it (chain_pricing.start_spill_checks); the GPU pass hands one of its PTX
    # children. None: each check starts a child of its own when the planner asks. Not part
    # of the plan cache key.
    spill_worker: Any = field(default=None, compare=False)
    # Planning does not wait for spill checks still running when it ends: the plan comes
    # back with ``FusionPlan.pending_checks`` (the caller asks ``checks_held()`` before it
    # uses the plan for good; the plan cache keeps it only then). The GPU pass asks once
    # its kernels are lowered. Not part of the plan cache key.
    defer_spill_checks: bool = field(default=False, compare=False)
    # Scatters and gathers over proved sorted fixed-length segments planned as row
    # reductions and broadcasts (stitch.hlo.segments_as_rows; modules XLA has not optimized
    # only).
    segments_as_rows: bool = True
