"""Code budget: a stitched kernel whose generated code is large is built at a narrower
vector width when the latency-evaluator prices that within ``CODE_TOLERANCE``.

Why: on the GPU path most of stitch's compile time is LLVM (O3, NVPTX codegen) and ptxas
on the largest kernels, and their size grows with the vector width: each thread handles
``vw`` consecutive elements in straight-line code, recomputed producers included
(transformer_train tiny's largest kernel: 4,404 Kernel IR statements at width 4, 1,473 at
width 1; 5.09 against 5.27 modeled µs). A few percent of a kernel's modeled time is below
what the model can resolve, while the build time saved is seconds per compile.

Only block-scope schedules are narrowed (global-scope and GEMM-chain kernels keep theirs).
The size is known exactly only once a kernel is lowered. A kernel whose estimate (two
statements per member op and vector lane; transformer_train's kernels over the budget
measure 2.5-6.3) is already over the budget is lowered narrow at once; one the estimate
misses is lowered a second time when its Kernel IR turns out over the budget, which costs
a fraction of its build at the wider width.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from stitch.config import env_count

log = logging.getLogger(__name__)

# Kernel IR statements above which a narrower schedule is looked for (the tiny zoo training
# steps' largest kernels at width 4: 1,200-4,400; the budget narrows no kernel of a
# full-size zoo plan: docs/benchmarks.md, bench-code-budget).
CODE_BUDGET = 1000
# Modeled slowdown (fraction of the kernel's time) accepted for the narrower kernel.
CODE_TOLERANCE = 0.05
BUDGET_ENV = "STITCH_CODE_BUDGET"


def budget_setting() -> int | None:
    """The budget ``$STITCH_CODE_BUDGET`` asks for: a positive number of Kernel IR
    statements, ``off`` (None: every kernel built as tuned), unset: CODE_BUDGET."""
    return env_count(BUDGET_ENV, CODE_BUDGET, "Kernel IR statements")


@dataclass(frozen=True)
class Narrowed:
    """A kernel built narrower than the tuner's pick: widest vector width and modeled µs of
    both schedules, Kernel IR statements of the one built."""
    name: str
    width: int
    narrow_width: int
    statements: int
    modeled_us: float
    narrow_modeled_us: float


def statements(kernel: Any) -> int:
    """Kernel IR statements of ``kernel``, nested bodies included (its code size)."""
    from stitch.codegen import kir
    return sum(1 for _ in kir.walk_stmts(kernel.body))


def estimated_statements(schedule: Any) -> int:
    """An estimate of a block-scope schedule's Kernel IR statements: two per member op and
    vector lane of each part (small kernels measure about one, the large kernels of
    transformer_train's step 2.5-6.3)."""
    return sum(2 * p.vector_width * len(p.members) for p in schedule.parts)


def widest(schedule: Any) -> int:
    """The widest vector width of the schedule's parts (1 when it has none)."""
    return max((p.vector_width for p in getattr(schedule, "parts", ()) or ()), default=1)


def _block_scope(schedule: Any) -> bool:
    parts = getattr(schedule, "parts", None)
    return bool(parts) and all(p.kind != "global" for p in parts)


def narrower_schedule(graph: Any, schedule: Any, spec: Any) -> Any | None:
    """The narrowest block-scope schedule of ``schedule``'s members whose modeled time is
    within CODE_TOLERANCE of ``schedule``'s (widths tried: 1, then up to 2), or None."""
    from stitch.errors import StitchError
    from stitch.schedule.tuner import schedule_kernel

    wide = widest(schedule)
    for widths in ((1,), (1, 2)):
        if max(widths) >= wide:
            break
        try:
            narrow = schedule_kernel(graph, schedule.members, spec, vector_widths=widths)
        except StitchError as exc:
            log.debug("no schedule at widths %s: %s", widths, exc)
            continue
        if narrow.modeled_us <= schedule.modeled_us * (1 + CODE_TOLERANCE):
            return narrow
    return None


def lower_within_budget(graph: Any, schedule: Any, spec: Any, name: str,
                        lower: Callable[[Any], Any], budget: int | None = None
                        ) -> tuple[Any, Narrowed | None]:
    """``lower(schedule)``, or, for a kernel over ``budget`` (default CODE_BUDGET) Kernel IR
    statements, the lowering of a narrower schedule within tolerance (``Narrowed`` says
    which). A narrower schedule that fails to lower, or is not smaller, leaves the kernel
    as tuned."""
    budget = CODE_BUDGET if budget is None else budget
    if widest(schedule) == 1 or not _block_scope(schedule):
        return lower(schedule), None
    tried = estimated_statements(schedule) > budget
    if tried:
        narrow = narrower_schedule(graph, schedule, spec)
        if narrow is not None:
            got = _lower_narrow(narrow, name, lower)
            if got is not None:
                return got, _narrowed(name, schedule, narrow, got)
    lowered = lower(schedule)
    size = statements(lowered.kernel)
    if size <= budget or tried:
        return lowered, None
    narrow = narrower_schedule(graph, schedule, spec)
    got = _lower_narrow(narrow, name, lower) if narrow is not None else None
    if got is None or statements(got.kernel) >= size:
        return lowered, None
    return got, _narrowed(name, schedule, narrow, got)


def _lower_narrow(narrow: Any, name: str, lower: Callable[[Any], Any]) -> Any | None:
    from stitch.codegen.errors import CodegenError
    from stitch.errors import StitchError
    try:
        return lower(narrow)
    except (CodegenError, StitchError) as exc:
        log.info("kernel %s: the narrower schedule does not lower (%s); built as tuned",
                 name, exc)
        return None


def _narrowed(name: str, schedule: Any, narrow: Any, lowered: Any) -> Narrowed:
    record = Narrowed(name, widest(schedule), widest(narrow), statements(lowered.kernel),
                      schedule.modeled_us, narrow.modeled_us)
    log.debug("kernel %s built at vector width %d, not %d: %d Kernel IR statements, "
              "%.2f -> %.2f modeled µs", name, record.narrow_width, record.width,
              record.statements, record.modeled_us, record.narrow_modeled_us)
    return record
