"""Measured kernel times against the latency-evaluator's, per target: the calibration tables
the GPU kit's local step writes (``python -m bench.gpu_kit.ingest``) under
``stitch/cost/calibration/<target>.json``.

A table records the device and date it came from, each stitched kernel's modeled and
measured µs, and their summary: ``scale`` (the median of measured / modeled), the rank
correlation and the median relative error. Its optional ``efficiencies`` (the kit's
``tensor_cores`` step: GEMM-bound kernels checked against jax and timed at real sizes) give
the fraction of the unit's peak each reached; ``Calibration.efficiency(unit, kind)`` is their
median, read by ``stitch.cost.mma_efficiency``. A table without them (written before they
existed) reads as having none; readers that predate them ignore the key, so ``FORMAT`` stays 1. ``load_calibration(target)`` reads it (None where
no GPU check has run for that target); ``Calibration.calibrated_us(modeled)`` applies the
scale. The planner does not apply it on its own: its decisions compare modeled times, which a
common scale leaves in the same order.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .gpu_specs import get_spec

CALIBRATION_DIR = Path(__file__).with_name("calibration")
FORMAT = 1


@dataclass(frozen=True)
class KernelSample:
    model: str
    entry: str
    modeled_us: float
    measured_us: float


@dataclass(frozen=True)
class KernelEfficiency:
    """One GEMM-bound kernel timed at a real size: the fraction of its unit's peak
    (``stitch.cost.gemm_rates`` precision class: "f16/bf16", "tf32", "f32") it reached."""
    name: str
    kind: str                 # attention_backward | lm_head_backward | gemm_chain
    unit: str
    flops: float
    measured_us: float
    fraction_of_peak: float
    xla_us: float | None = None


@dataclass(frozen=True)
class Calibration:
    target: str
    device: str
    date: str
    samples: tuple[KernelSample, ...] = field(default=())
    efficiencies: tuple[KernelEfficiency, ...] = field(default=())

    def efficiency(self, unit: str, kind: str | None = None) -> float | None:
        """Median fraction of peak of the kernels measured on ``unit`` (of ``kind`` where
        given and measured, else of any kind); None where none was."""
        on_unit = [e for e in self.efficiencies if e.unit == unit]
        of_kind = [e for e in on_unit if e.kind == kind] if kind else []
        chosen = of_kind or on_unit
        return statistics.median(e.fraction_of_peak for e in chosen) if chosen else None

    @property
    def scale(self) -> float:
        """Median measured / modeled (1.0 without samples)."""
        ratios = [s.measured_us / s.modeled_us for s in self.samples if s.modeled_us > 0]
        return statistics.median(ratios) if ratios else 1.0

    @property
    def median_relative_error(self) -> float | None:
        errors = [abs(s.measured_us - s.modeled_us) / s.measured_us
                  for s in self.samples if s.measured_us > 0]
        return statistics.median(errors) if errors else None

    @property
    def rank_correlation(self) -> float | None:
        return spearman([s.modeled_us for s in self.samples],
                        [s.measured_us for s in self.samples])

    def calibrated_us(self, modeled_us: float) -> float:
        return modeled_us * self.scale

    def to_json(self) -> dict:
        return {"format": FORMAT, "target": self.target, "device": self.device,
                "date": self.date, "scale": self.scale,
                "rank_correlation": self.rank_correlation,
                "median_relative_error": self.median_relative_error,
                "kernels": [s.__dict__ for s in self.samples],
                "efficiencies": [e.__dict__ for e in self.efficiencies]}


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):            # ties share their mean rank
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (None under 3 pairs or a constant side)."""
    if len(a) != len(b) or len(a) < 3:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    if va == 0 or vb == 0:
        return None
    return cov / (va * vb) ** 0.5


def path_for(target: str, directory: Path | None = None) -> Path:
    get_spec(target)                          # an unknown target is an UnknownTargetError
    return (directory or CALIBRATION_DIR) / f"{target.lower()}.json"


def save_calibration(calibration: Calibration, directory: Path | None = None) -> Path:
    path = path_for(calibration.target, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration.to_json(), indent=1) + "\n")
    return path


def load_calibration(target: str, directory: Path | None = None) -> Calibration | None:
    path = path_for(target, directory)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return Calibration(target=data["target"], device=data["device"], date=data["date"],
                       samples=tuple(KernelSample(**k) for k in data["kernels"]),
                       efficiencies=tuple(KernelEfficiency(**e)
                                          for e in data.get("efficiencies", ())))
