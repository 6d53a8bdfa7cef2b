"""Payback: on the GPU path a stitched kernel is built only when the modeled time it saves
per step repays its estimated build within ``PAYBACK_STEPS`` steps.

Why: building a kernel (LLVM O3, NVPTX codegen, ptxas) costs 0.04-1.2 CPU seconds, growing
with its code; what it saves is the modeled time of the XLA kernels it replaces less its
own, per call of the compiled function. Most kernels repay their build within 10^4-10^5
steps. Some save 0.3-6 µs for a second of build and would repay it only after
10^5-5·10^5 steps: at tiny sizes the largest kernels (transformer_train tiny: 8 of 34;
docs/benchmarks.md, the reading after bench-pass-compile-gpu), at full size a few small
ones (transformer_train full: up to 5 of 62 alone, bert_layer_train 1 of 13, dien_train 2
of 20). Those are left to XLA.

The saving is priced by the planner's delta cost model on both sides (the XLA kernels the
kernel replaces, the kernel itself), times the graph's trip-count weight. The build is
estimated from the kernel's Kernel IR statements once it is lowered (``BUILD_S_PER_KERNEL``
+ ``BUILD_S_PER_STATEMENT`` per statement: a least-squares fit over transformer_train
tiny's 34 kernels on the 2-core development machine; a faster host builds sooner, so the
rule errs towards leaving kernels to XLA there). ``STITCH_PAYBACK_STEPS`` sets the steps
(``off``: every kernel is built). The host path builds every kernel: its builds are checks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from stitch.config import env_count

PAYBACK_STEPS = 100_000
PAYBACK_ENV = "STITCH_PAYBACK_STEPS"
BUILD_S_PER_KERNEL = 0.078
BUILD_S_PER_STATEMENT = 0.00076


def payback_setting() -> int | None:
    """The steps ``$STITCH_PAYBACK_STEPS`` asks for: a positive number, ``off`` (None: every
    kernel is built), unset: PAYBACK_STEPS."""
    return env_count(PAYBACK_ENV, PAYBACK_STEPS, "steps")


def estimated_build_s(statements: int) -> float:
    """CPU seconds to emit and assemble a kernel of ``statements`` Kernel IR statements."""
    return BUILD_S_PER_KERNEL + BUILD_S_PER_STATEMENT * statements


@dataclass(frozen=True)
class Unpaid:
    """A kernel left to XLA: its modeled saving per step, estimated build, and the steps
    the saving takes to repay the build (None: it saves nothing)."""
    name: str
    gain_us: float
    build_s: float
    steps: float | None

    def reason(self, limit: int) -> str:
        if self.steps is None:
            return (f"modeled to save nothing per step ({self.gain_us:+.2f} µs): "
                    f"left to XLA ({PAYBACK_ENV})")
        return (f"modeled to save {self.gain_us:.2f} µs per step, it repays its estimated "
                f"{self.build_s:.2f} s build after {self.steps:,.0f} steps, more than "
                f"{PAYBACK_ENV}={limit:,}: left to XLA")


def unpaid(name: str, gain_s: float, statements: int, limit: int) -> Unpaid | None:
    """The record of a kernel that does not repay its build within ``limit`` steps, or None
    when it does."""
    build_s = estimated_build_s(statements)
    if gain_s <= 0:
        return Unpaid(name, gain_s * 1e6, build_s, None)
    steps = build_s / gain_s
    return Unpaid(name, gain_s * 1e6, build_s, steps) if steps > limit else None


class BaselineKernels:
    """A graph plan's baseline kernels by the ops they hold, so that what a member set
    replaces is found without a scan of every kernel per set (a 48-layer step: 400 sets
    against 1,500 kernels). Lists keep the baseline's order: sums over them are the sums
    of the scan, to the last bit."""

    def __init__(self, baseline: Any) -> None:
        self.baseline = baseline
        self.kernels = baseline.kernels
        self._of_op: dict[int, list[int]] = {}
        self._empty = [i for i, k in enumerate(self.kernels) if not k.members]
        for i, k in enumerate(self.kernels):
            for v in k.members:
                self._of_op.setdefault(v, []).append(i)

    def _sharing(self, members: Iterable[int]) -> set[int]:
        return {i for v in members for i in self._of_op.get(v, ())}

    def touching(self, members: Iterable[int]) -> list[Any]:
        """The kernels sharing an op with ``members``."""
        return [self.kernels[i] for i in sorted(self._sharing(members))]

    def inside(self, members: frozenset[int]) -> list[Any]:
        """The kernels all of whose ops are in ``members``."""
        found = self._sharing(members)
        found.update(self._empty)
        return [self.kernels[i] for i in sorted(found)
                if members.issuperset(self.kernels[i].members)]


_LAST_INDEX: BaselineKernels | None = None


def baseline_kernels(graph_plan: Any) -> BaselineKernels:
    """``BaselineKernels`` of ``graph_plan.baseline``, built once while the pass asks about
    one graph (the last one asked about is kept)."""
    global _LAST_INDEX
    held = _LAST_INDEX
    baseline = graph_plan.baseline
    if held is None or held.baseline is not baseline or held.kernels is not baseline.kernels:
        held = _LAST_INDEX = BaselineKernels(baseline)
    return held


def modeled_gain_s(graph_plan: object, members: frozenset[int], cost: object) -> float:
    """Modeled seconds per call a kernel of ``members`` saves against the XLA kernels it
    replaces (``graph_plan.baseline``'s kernels inside it), both by the delta cost model,
    times the graph's trip-count weight."""
    replaced = sum(k.cost.total_s for k in baseline_kernels(graph_plan).inside(members))
    weight = graph_plan.stitched.weight                                    # type: ignore[attr-defined]
    return (replaced - cost.kernel(members).total_s) * weight             # type: ignore[attr-defined]
