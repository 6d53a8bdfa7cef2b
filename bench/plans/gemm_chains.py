"""GEMM chains and attention: stitch's gemm_chain kernel against XLA's own
kernels for the same ops, and the schedule search against exhaustive enumeration
(``python -m bench gemm-chains``).

Per zoo model (``gemm_chain_g1..g12``, ``attention_*``, full size) and target, from the
committed XLA-optimized fixture: stitch plans it (``stitch.plan``, GEMM chains on); the
chain kernel's members are matched with the XLA kernels that compute the same ops (the
baseline groups holding them: the two GEMM fusions or cuBLAS calls, the softmax kernel, a
split-K reduce). Both sides are modeled twice:

- latency-evaluator: the chain kernel by ``stitch.cost.gemm_tile.chain_cost`` at the
  schedule the Markov-guided search finds; XLA's GEMMs by ``gemm_cost`` with the Triton
  tile of their backend config (the fixture's: XLA compiled them deviceless, without
  autotuning) and, as a second yardstick, the best of ``AUTOTUNE_TILES`` (what autotuning
  could pick); XLA's memory kernels by stitch's schedule tuner (``schedule_kernel``), as
  bench/plans/zoo.py schedules XLA's fusions;
- XLA's cost formula (bench/xla_formula.py): T = 1 us + C + M - 0.95 min(C, M) per
  launch, M = counted HBM bytes / bandwidth, C = flops / (active SMs x active FPUs x 2 x
  clock) with XLA's ComputeTime scaling (min(blocks, SMs), min(threads per block, FPUs per
  SM)), GEMM flops 2 m n k (FP32 FPUs: XLA's formula has no tensor cores), memory ops
  counted by ``kernel_flops``.

Why the chain kernel's formula time is high (``FormulaView``, second table): its blocks and
threads (the SMs and FPU lanes ComputeTime credits), its executed flops over the chain's
(deep tilings recompute the first GEMM per h-block), and the formula's bound for any one
kernel doing the chain (flops once, minimal bytes, every SM and FPU): XLA's formula time
over that bound is the ceiling no schedule can pass. With one warp per 16 rows (threads =
2 x block_m) a flat kernel's blocks x threads is 2 x batch x m whatever the tiles, so
batch-1 chains got a small share of the GPU under the formula unless h is split
(recomputing the first GEMM); warp columns (several warps per 16 rows, each on a slice of
n, folded at the end) give small block_m tiles a full SM's threads. Splitting n across
blocks (``n_split``: each block sums its share of n into f32 partials in global scratch,
a second launch of the kernel adds them in order — after a softmax weighted by the splits'
row maxima and sums, FlashDecoding's combine; not for other row reductions over n)
multiplies the blocks without recomputing anything. The bench plans with it allowed
(``ExplorerOptions.chain_grid_sync``: the GPU pass with STITCH_GRID_SYNC on). Under the
formula an n-split kernel is two launches: the partials launch (the chain's flops, its
bytes with the f32 partials written instead of the result) and the combine launch (one
add per partial, the partials read and the result written), both on the same grid.

The search comparison: per chain (G1-G12, S1-S9) and target, exhaustive enumeration of
the pruned space vs the Markov-guided construction (32 walks, seed 0): the space's optimum against the
fastest schedule the walks cost (quality, 1.00 = the optimum found), the schedule each
returns (``settle``) and search time (measured on this machine).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import stitch
from bench.report import geomean
from bench.xla_formula import DEVICES, XlaDevice, kernel_flops, kernel_time
from stitch.hlo.graph import OpGraph
from stitch.hlo.op_classes import OpClass
from stitch.pricing.chain_pricing import chain_price, graph_chains, xla_gemm_cost
from stitch.pricing.delta import CostModel, kernel_hbm_bytes
from stitch.cost.gemm_tile import GemmTile, TileCost
from stitch.cost.gpu_specs import get_spec
from stitch.explorer.planner import ExplorerOptions
from stitch.models.mcfuser import ATTENTIONS, GEMM_CHAINS
from stitch.schedule.gemm_chain_space import exhaustive, markov_search
from stitch.schedule.tuner import ScheduleError, schedule_kernel
from hlo_fixtures import DATA

TARGETS = ("a100", "h100")
GOAL = 1.5
# Triton tiles autotuning could pick (block_m, block_n, block_k, warps, stages).
AUTOTUNE_TILES = tuple(GemmTile(m, n, k, w, s, 1, "autotune")
                       for m, n, k, w, s in ((16, 16, 32, 2, 1), (32, 32, 32, 4, 2),
                                             (64, 32, 32, 4, 3), (64, 64, 32, 4, 3),
                                             (128, 64, 32, 4, 3), (64, 128, 32, 4, 3),
                                             (128, 128, 32, 8, 3), (128, 64, 64, 8, 2)))
Progress = Callable[[str], None]


def chain_models() -> list[str]:
    return [f"gemm_chain_{g}" for g in GEMM_CHAINS] + [f"attention_{a}" for a in ATTENTIONS]


@dataclass
class Side:
    kernels: list[str] = field(default_factory=list)
    latency_us: float = 0.0
    formula_us: float = 0.0
    tuned_latency_us: float = 0.0      # XLA's GEMMs at the best AUTOTUNE_TILES tile


@dataclass
class ChainRow:
    model: str
    target: str
    dims: str
    planned: bool                      # the plan holds a gemm_chain kernel
    schedule: str
    mbci: bool                         # unfused chain below the ridge (MCFuser's MBCI)
    intensity: float                   # flops per unfused HBM byte
    ridge: float
    stitch: Side
    xla: Side
    registers: int = 0
    ptxas_registers: str = ""          # ptxas -v of the planned schedule as codegen builds it
    smem_bytes: int = 0
    formula: "FormulaView | None" = None

    @property
    def latency_ratio(self) -> float:
        return self.xla.latency_us / self.stitch.latency_us

    @property
    def tuned_ratio(self) -> float:
        return self.xla.tuned_latency_us / self.stitch.latency_us

    @property
    def formula_ratio(self) -> float:
        return self.xla.formula_us / self.stitch.formula_us

    @property
    def formula_ceiling(self) -> float:
        """The most any one chain kernel can reach under XLA's formula (FormulaView)."""
        return self.xla.formula_us / self.formula.bound_us if self.formula else math.inf


def _formula_gemm(device: XlaDevice, tile: TileCost, nbytes: float) -> float:
    """XLA's formula for a GEMM launch with its ComputeTime scaling (module docstring)."""
    return _formula_launch_us(device, tile.flops, nbytes, tile.blocks, tile.threads)


@dataclass(frozen=True)
class FormulaLaunch:
    """One chain kernel launch under XLA's formula, with what its ComputeTime scaling saw."""

    schedule: str
    blocks: int
    threads: int
    flops: float                   # executed: padding and recomputed first GEMMs included
    us: float
    latency_us: float              # the same schedule under the latency-evaluator


@dataclass(frozen=True)
class FormulaView:
    """Why the chain kernel's formula time is what it is.

    ``chosen``: the planned schedule. ``space_best``: the schedule of the searched space the
    formula likes best. ``bound_us``: the least time XLA's formula gives ANY one kernel that
    does the chain's flops (no recomputation, no padding) and moves its minimal bytes, on
    every SM with every FPU busy; ``xla_us / bound_us`` is the most any chain kernel can
    reach against XLA's kernels under that formula."""

    chosen: FormulaLaunch
    space_best: FormulaLaunch
    near_best: FormulaLaunch       # the formula's favourite within 10% of the fastest latency
    min_flops: float
    min_bytes: float
    bound_us: float
    sms: int
    fpus_per_sm: int

    def why(self) -> str:
        """blocks x threads, the SMs and FPU lanes the formula credits, flops over minimal."""
        c = self.chosen
        sms = min(c.blocks, self.sms)
        lanes = min(c.threads, self.fpus_per_sm) / self.fpus_per_sm
        return (f"{c.blocks}×t{c.threads}: {sms}/{self.sms} SMs × {lanes:.0%} FPUs, "
                f"flops {c.flops / self.min_flops:.2f}× min")


def _formula_launch_us(device: XlaDevice, flops: float, nbytes: float, blocks: int,
                       threads: int) -> float:
    """T = 1 us + C + M - 0.95 min(C, M), C on min(blocks, SMs) x min(threads, FPUs/SM)."""
    fpus = min(blocks, device.core_count) * min(threads, device.fpus_per_core)
    compute = flops / (fpus * 2 * device.clock_rate_ghz * 1e9)
    memory = nbytes / device.memory_bandwidth
    return (1e-6 + compute + memory - 0.95 * min(compute, memory)) * 1e6


def _formula_launch(spec, device: XlaDevice, dims, between_flops: float, nbytes: float,
                    schedule) -> FormulaLaunch:
    """One chain schedule under XLA's formula; an n-split one as its two launches (module
    docstring)."""
    from stitch.cost.gemm_tile import chain_cost, chain_grid, partial_bytes
    cost = chain_cost(spec, dims, schedule)
    # The ops between the GEMMs run once per score element per h-block (deep tilings
    # recompute them with the first GEMM).
    whole_n = replace(schedule, n_split=1)
    h_blocks = chain_grid(dims, whole_n) // max(chain_grid(dims, replace(
        whole_n, expression="n(k,h)")), 1)
    flops = cost.flops + between_flops * h_blocks
    us = _formula_launch_us(device, flops, nbytes, cost.blocks, cost.threads)
    partials = partial_bytes(dims, schedule)
    if partials:
        result = dims.batch * dims.m * dims.h * dims.result_bytes
        # A sum per partial; after a softmax also a weight (exp) and a multiply per split.
        adds = (schedule.n_split * (3 if dims.softmax else 1) - 1) * dims.batch * dims.m * dims.h
        us = _formula_launch_us(device, flops, nbytes - result + partials, cost.blocks,
                                cost.threads) + \
            _formula_launch_us(device, adds, partials + result, cost.blocks, cost.threads)
        flops += adds
    return FormulaLaunch(schedule.text(), cost.blocks, cost.threads, flops, us, cost.us)


def formula_view(spec, device: XlaDevice, dims, between_flops: float, nbytes: float,
                 chosen) -> FormulaView:
    """The chain kernel under XLA's formula: the chosen schedule, the formula's favourite
    of the searched space, and the bound of any one kernel (``FormulaView``)."""
    from stitch.schedule.gemm_chain_space import EQUIVALENT_WITHIN, enumerate_schedules
    launches = [_formula_launch(spec, device, dims, between_flops, nbytes, s)
                for s in enumerate_schedules(spec, dims)]
    best = min(launches, key=lambda f: f.us)
    fastest = min(f.latency_us for f in launches)
    near = min((f for f in launches if f.latency_us <= fastest * (1 + EQUIVALENT_WITHIN)),
               key=lambda f: f.us)
    min_flops = dims.flops + between_flops
    bound = _formula_launch_us(device, min_flops, nbytes, device.core_count,
                               device.fpus_per_core)
    return FormulaView(_formula_launch(spec, device, dims, between_flops, nbytes, chosen),
                       best, near, min_flops, nbytes, bound, device.core_count,
                       device.fpus_per_core)


def _memory_latency_us(graph: OpGraph, spec, cost: CostModel, members: frozenset[int]) -> float:
    try:
        return schedule_kernel(graph, members, spec).modeled_us
    except ScheduleError:
        return cost.kernel(members).total_s * 1e6


def _ptxas_registers(graph: OpGraph, chain, schedule, target: str) -> str:
    """ptxas's registers per thread (and spills) of the chain kernel codegen builds for
    ``schedule`` on ``target``'s arch; a failure is reported in the cell."""
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.gemm_chain import lower_gemm_chain
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble
    from stitch.compiler import arch_of
    from stitch.schedule.chain_tiling import tiling_for
    arch = arch_of(target)
    try:
        kernel = lower_gemm_chain(graph, chain, tiling_for(schedule, chain.h), "chain",
                                  arch).kernel
        report = assemble(emit_ptx(kernel, arch), arch, kernel_name="chain")["chain"]
    except CodegenError as exc:
        return f"({type(exc).__name__})"
    spills = report.spill_store_bytes + report.spill_load_bytes
    return f"{report.registers}" + (f" (spills {spills} B)" if spills else "")


def compare(model: str, target: str, tf32: bool | None = None,
            ptxas: bool = False, grid_sync: bool = False) -> ChainRow | None:
    """One model on one target (module docstring); None without a fixture or a chain.
    ``tf32``: chain kernels may use TF32 tensor cores (ExplorerOptions.chain_tf32; default:
    what the GPU compile path plans with). ``grid_sync``: chain schedules may split n
    across blocks (ExplorerOptions.chain_grid_sync)."""
    from stitch.xla_pass.entry import GPU_CHAIN_TF32
    tf32 = GPU_CHAIN_TF32 if tf32 is None else tf32
    path = DATA / model / f"full.gpu-{target}.hlo"
    if not path.exists():
        return None
    plan = stitch.plan(path.read_text(), target, options=ExplorerOptions(
        chain_tf32=tf32, chain_grid_sync=grid_sync))
    spec, device = get_spec(target), DEVICES[target]
    for result in plan.graphs:
        graph = result.graph
        chains = graph_chains(graph).chains
        if not chains:
            continue
        chain = chains[0]
        planned = next((k for k in result.stitched.kernels if k.kind == "gemm_chain"), None)
        price = chain_price(graph, chain, spec, tf32=tf32, check_spills=True,   # as the GPU pass
                            grid_sync=grid_sync)
        cost = CostModel(graph, spec, chain_tf32=tf32)
        core = {v for v in chain.members if not graph.is_free(v)}
        xla = Side()
        for k in result.baseline.kernels:
            members = frozenset(k.members)
            if not members & core or not k.cost.launches:
                continue
            xla.kernels.append(k.name.split(".")[-1] + ":" + k.kind)
            nbytes = kernel_hbm_bytes(graph, members)
            gemm = next((v for v in members if graph.nodes[v].op_class is OpClass.COMPUTE),
                        None)
            if gemm is not None:
                tile = xla_gemm_cost(graph, gemm, spec)
                xla.latency_us += tile.us
                xla.tuned_latency_us += min(
                    [tile.us] + [xla_gemm_cost(graph, gemm, spec, t).us for t in AUTOTUNE_TILES])
                xla.formula_us += _formula_gemm(device, tile, nbytes)
            else:
                t = _memory_latency_us(graph, spec, cost, members)
                xla.latency_us += t
                xla.tuned_latency_us += t
                xla.formula_us += kernel_time(device, kernel_flops(graph, members),
                                              nbytes).total_s * 1e6
        members = frozenset(chain.members)
        between = [v for v in chain.between if not graph.is_free(v)]
        chain_tile = price.cost
        between_flops = kernel_flops(graph, between)
        chain_bytes = kernel_hbm_bytes(graph, members)
        view = formula_view(spec, device, price.dims, between_flops, chain_bytes,
                            price.schedule)
        ours = Side([f"gemm_chain ({len(members)} ops)"], chain_tile.us, view.chosen.us,
                    chain_tile.us)
        d = price.dims
        score = d.batch * d.m * d.n * 4
        unfused = (kernel_hbm_bytes(graph, members) + 2 * score
                   + (2 * score if chain.softmax else 0))
        rate = (1024.0 if d.mma_allowed(spec) else spec.fp32_cores_per_sm * 2.0) \
            * spec.sm_count * spec.clock_hz
        intensity = d.flops / unfused
        ridge = rate / spec.hbm_bandwidth
        return ChainRow(model, target,
                        f"b{d.batch} m{d.m} n{d.n} k{d.k} h{d.h}{' softmax' if d.softmax else ''}",
                        planned is not None, price.schedule.text(), intensity < ridge,
                        intensity, ridge, ours, xla, registers=chain_tile.registers,
                        smem_bytes=chain_tile.smem_bytes,
                        ptxas_registers=_ptxas_registers(graph, chain, price.schedule, target)
                        if ptxas else "", formula=view)
    return None


@dataclass
class SearchRow:
    name: str
    target: str
    exhaustive_us: float
    markov_us: float
    space: int
    markov_evaluated: int
    exhaustive_s: float
    markov_s: float
    fastest_us: float               # the optimum of the space (exhaustive)
    markov_fastest_us: float        # the fastest schedule the walks costed

    @property
    def quality(self) -> float:
        """Search quality: the space's optimum over the fastest the walks found."""
        return self.fastest_us / self.markov_fastest_us


def search_rows(targets=TARGETS, progress: Progress | None = None) -> list[SearchRow]:
    from stitch.cost.gemm_tile import ChainDims
    rows = []
    shapes = [(g.upper(), s, False, False) for g, s in GEMM_CHAINS.items()] + \
        [(sid, s, True, False) for sid, _, s in ATTENTIONS.values()]
    for target in targets:
        spec = get_spec(target)
        # The space with n split across blocks too (ChainDims.grid_sync), on H100 only:
        # its enumeration takes about 5x as long.
        split = [(f"{g.upper()} nsplit", s, False, True) for g, s in GEMM_CHAINS.items()] \
            if target == "h100" else []
        for name, s, softmax, grid_sync in shapes + split:
            dims = ChainDims(s.batch, s.m, s.n, s.k, s.h, "f32", softmax, grid_sync=grid_sync)
            ex = exhaustive(spec, dims)
            mk = markov_search(spec, dims)
            rows.append(SearchRow(name, target, ex.cost.us, mk.cost.us, ex.space,
                                  mk.evaluated, ex.seconds, mk.seconds, ex.fastest_s * 1e6,
                                  mk.fastest_s * 1e6))
            if progress:
                progress(f"search {name} {target}: exhaustive {ex.cost.us:.2f} us "
                         f"({ex.seconds:.2f} s), markov {mk.cost.us:.2f} us ({mk.seconds:.2f} s)")
    return rows


def collect(models: list[str] | None = None, targets=TARGETS,
            progress: Progress | None = None, grid_sync: bool = True) -> list[ChainRow]:
    """Every model on every target; ``grid_sync``: chains may split n (``compare``)."""
    rows = []
    for model in models or chain_models():
        for target in targets:
            row = compare(model, target, ptxas=True, grid_sync=grid_sync)
            if row is not None:
                rows.append(row)
                if progress:
                    progress(f"{model} {target}: {row.latency_ratio:.2f}x latency, "
                             f"{row.formula_ratio:.2f}x formula")
    return rows


def formula_markdown(rows: list[ChainRow]) -> list[str]:
    """Why the chain kernels lose under XLA's formula, and the bound of any one kernel."""
    rows = [r for r in rows if r.formula is not None]
    if not rows:
        return []
    capped = [r for r in rows if r.formula_ceiling < GOAL]
    lines = [
        "", "Under XLA's formula. C = executed flops / (min(blocks, SMs) × "
        "min(threads per block, FPUs per SM) × 2 × clock): a chain kernel with few blocks "
        "(batch 1, m / block_m row tiles) or thin blocks is charged its flops on a fraction "
        "of the GPU, and a deep tiling (`nk`, h bound to blocks) executes the first GEMM once "
        "per h-block. *Bound*: the least time the formula gives any one kernel doing the "
        "chain's flops once and moving its minimal HBM bytes (A, B, D and the ops' other "
        "inputs read once, the result written once) on every SM and every FPU; XLA µs / bound "
        "is the most any chain kernel can reach under the formula. *Space's best*: the "
        "schedule of the searched space the formula likes best (with its latency-evaluator "
        "time next to the chosen one's): the search keeps choosing by the latency-evaluator. "
        "*Near best*: the formula's favourite among the schedules within 10% of the space's "
        "fastest under the latency-evaluator (what a formula-aware tie-break could take).",
        "",
        f"Rows whose ceiling is below {GOAL}× (no one kernel can reach the goal under XLA's "
        f"formula: its compute term alone, on the whole GPU, exceeds XLA's kernels' time / "
        f"{GOAL}): {len(capped)} of {len(rows)}"
        + (" (" + ", ".join(f"{r.model} {r.target}" for r in capped) + ")" if capped else "")
        + ".",
        "",
        "| model | target | chosen under the formula | chain µs formula | bound µs | XLA µs "
        "formula | × formula | ceiling × | space's best under the formula | its µs formula "
        "| its latency µs (chosen's) | near best µs formula (×) |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        f = r.formula
        lines.append(
            f"| {r.model} | {r.target} | {f.why()} | {r.stitch.formula_us:.2f} | "
            f"{f.bound_us:.2f} | {r.xla.formula_us:.2f} | {r.formula_ratio:.2f}× | "
            f"{r.formula_ceiling:.2f}×{'' if r.formula_ceiling >= GOAL else ' (capped)'} | "
            f"`{f.space_best.schedule}` ({f.space_best.blocks}×t{f.space_best.threads}) | "
            f"{f.space_best.us:.2f} | {f.space_best.latency_us:.2f} "
            f"({r.stitch.latency_us:.2f}) | {f.near_best.us:.2f} "
            f"({r.xla.formula_us / f.near_best.us:.2f}×) |")
    return lines


def markdown(rows: list[ChainRow], search: list[SearchRow]) -> list[str]:
    ok = [r for r in rows if r.planned and r.latency_ratio >= GOAL and r.formula_ratio >= GOAL]
    lines = [
        "All times modeled (no GPU): per zoo model (full size, fixture `full.gpu-<target>.hlo`), "
        "the `gemm_chain` kernel stitch plans against XLA's kernels for the same ops. "
        "Latency-evaluator: `stitch.cost.gemm_tile` for both sides' GEMM tiles (XLA's Triton "
        "tiles as the fixture's backend config gives them: deviceless XLA does not autotune; "
        "\"XLA tuned\" takes the best of 8 common Triton tiles per GEMM instead), stitch's schedule "
        "tuner for XLA's softmax / split-K reduce kernels. XLA formula: "
        "bench/xla_formula.py with XLA's ComputeTime scaling, FP32 FPUs on both sides. "
        "f32 GEMMs run TF32 tensor cores on both sides under the latency-evaluator (XLA's "
        "default precision; the chain's `mma` schedules are codegen's TF32 mma.sync m16n8k8, "
        "as the GPU pass plans them, ExplorerOptions.chain_tf32; only schedules codegen "
        "builds are searched, stitch/schedule/chain_tiling.py). MBCI: the unfused chain's flops per HBM byte below the ridge of its math "
        "unit (MCFuser's memory-bound compute-intensive chains). Chain schedules may split n "
        "across blocks (`nsplitS`: S blocks per output tile, f32 partials in global scratch, "
        "a second launch adds them; ExplorerOptions.chain_grid_sync, the GPU pass with "
        "STITCH_GRID_SYNC on; after a softmax the splits are combined by their row maxima and "
        "sums, FlashDecoding's split-KV; chains with another row reduction over n are never "
        "split).",
        "",
        f"Goal ≥ {GOAL}× under both models with a planned `gemm_chain` kernel: "
        f"{len(ok)} of {len(rows)} model × target rows"
        + "".join(f"; {t}: {sum(r in ok for r in rows if r.target == t)} of "
                  f"{sum(r.target == t for r in rows)} (latency "
                  f"{sum(r.latency_ratio >= GOAL for r in rows if r.target == t)}, formula "
                  f"{sum(r.formula_ratio >= GOAL for r in rows if r.target == t)})"
                  for t in sorted({r.target for r in rows}))
        + f"; n split in {sum('nsplit' in r.schedule for r in rows)} rows.",
        "",
        "| model | target | dims | MBCI (flop/B vs ridge) | planned | schedule | regs (model / ptxas) | smem KiB "
        "| chain µs | XLA µs (kernels) | × latency | XLA tuned µs | × vs tuned | chain µs formula "
        "| XLA µs formula | × formula |",
        "|---|---|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.target} | {r.dims} | {'yes' if r.mbci else 'no'} "
            f"({r.intensity:.0f} vs {r.ridge:.0f}) | {'yes' if r.planned else 'NO'} | "
            f"`{r.schedule}` | {r.registers} / {r.ptxas_registers or '–'} | {r.smem_bytes / 1024:.0f} | "
            f"{r.stitch.latency_us:.2f} | {r.xla.latency_us:.2f} ({len(r.xla.kernels)}: "
            f"{', '.join(r.xla.kernels)}) | {r.latency_ratio:.2f}× | "
            f"{r.xla.tuned_latency_us:.2f} | {r.tuned_ratio:.2f}× | {r.stitch.formula_us:.2f} | "
            f"{r.xla.formula_us:.2f} | {r.formula_ratio:.2f}× |")
    for target in sorted({r.target for r in rows}):
        sub = [r for r in rows if r.target == target]
        lines.append(f"| geomean | {target} | | | | | | | | | "
                     f"{geomean(r.latency_ratio for r in sub):.2f}× | | "
                     f"{geomean(r.tuned_ratio for r in sub):.2f}× | | | "
                     f"{geomean(r.formula_ratio for r in sub):.2f}× |")
    lines += formula_markdown(rows)
    lines += [
        "", "Schedule search per chain (f32, the zoo's dims): exhaustive enumeration of "
        "MCFuser's pruned space vs Gensor's Markov-guided construction (32 walks of at most 48 "
        "steps, seed 0; starts with n split until the grid covers the SMs where n may be split). "
        "Rows `Gi nsplit`: the space with n split across blocks (ChainDims.grid_sync; H100 only, "
        "for time). Quality = the space's fastest modeled time / the fastest the walks "
        "costed (1.000: the optimum found). Each search then returns, among the schedules it "
        "costed within 10% of its fastest, the one whose busiest SM executes the fewest flops "
        "(`settle`; chosen µs). Search times measured on this machine.", "",
        "| chain | target | space | optimum µs | exhaustive chosen µs | exhaustive s | Markov "
        "fastest µs | Markov chosen µs | states costed | Markov s | quality |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in search:
        lines.append(f"| {s.name} | {s.target} | {s.space} | {s.fastest_us:.2f} | "
                     f"{s.exhaustive_us:.2f} | {s.exhaustive_s:.2f} | "
                     f"{s.markov_fastest_us:.2f} | {s.markov_us:.2f} | {s.markov_evaluated} | "
                     f"{s.markov_s:.3f} | {s.quality:.3f} |")
    if search:
        lines += ["", f"Markov quality geomean {geomean(s.quality for s in search):.3f}, worst "
                  f"{min(s.quality for s in search):.3f}; search time per chain: Markov max "
                  f"{max(s.markov_s for s in search):.3f} s, exhaustive max "
                  f"{max(s.exhaustive_s for s in search):.2f} s."]
    return lines
