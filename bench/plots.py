"""PNG plots of the benchmark report (matplotlib, Agg: no display needed). Each function
writes one file and returns its path; the caller links it from the markdown. Rows come in
as the measures' own records (duck-typed: this module imports no measure)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from bench.report import fit_exponent  # noqa: E402

DPI = 110


def _save(fig, path: Path, layout: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if layout:
        fig.tight_layout()
    # No timestamp in the metadata: regenerating identical data gives identical files.
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return path


def _targets(rows) -> list[str]:
    order = ("v100", "a100", "h100", "h200")
    return sorted({r.target for r in rows}, key=lambda t: order.index(t) if t in order else 9)


def plans_ratios(rows: list, path: Path) -> Path:
    """Per model, stitch/XLA of mem kernels, mem bytes and XLA-formula time, per target."""
    names = sorted({r.model for r in rows if r.xla.mem_kernels})
    targets = _targets(rows)
    fig, axes = plt.subplots(1, len(targets), figsize=(4.2 * len(targets), 0.22 * len(names) + 1.6),
                             sharey=True)
    series = (("mem kernels", "mem_kernels", "tab:blue"), ("mem bytes", "mem_bytes", "tab:orange"),
              ("XLA-formula time", "formula_us", "tab:green"))
    for ax, target in zip(axes, targets):
        by_model = {r.model: r for r in rows if r.target == target}
        for i, (label, attr, color) in enumerate(series):
            ys = [n + (i - 1) * 0.27 for n in range(len(names))]
            xs = []
            for name in names:
                r = by_model.get(name)
                a = getattr(r.xla, attr) if r else 0
                xs.append(getattr(r.stitch, attr) / a if r and a else 0)
            ax.barh(ys, xs, height=0.27, color=color, label=label)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(f"{target.upper()}: stitch / XLA (lower is better)", fontsize=9)
        ax.set_xlim(0, 1.15)
        ax.tick_params(labelsize=7)
    axes[0].set_yticks(range(len(names)), names)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _save(fig, path, layout=False)


def planner_scaling(points: list[tuple[int, float, int]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(4.6, 3.4))
    ops = [o for o, _, _ in points]
    secs = [s for _, s, _ in points]
    ax.loglog(ops, secs, "o-", label="measured")
    if len(points) >= 2:
        k = fit_exponent([(o, s) for o, s, _ in points])
        scale = secs[0] / ops[0] ** k
        ax.loglog(ops, [scale * o ** k for o in ops], "--", color="gray", label=f"ops^{k:.2f}")
    ax.set_xlabel("ops in the graph")
    ax.set_ylabel("plan time (s)")
    ax.set_title("explorer time vs graph size (h100, beam)", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def compile_times(rows: list[tuple[str, float, float]], path: Path) -> Path:
    """(model, stitch seconds, jax seconds) per model."""
    fig, ax = plt.subplots(figsize=(6.4, 0.22 * len(rows) + 1.4))
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r[1] for r in rows], height=0.4, label="stitch.compiler.compile")
    ax.barh([y + 0.2 for y in ys], [r[2] for r in rows], height=0.4, label="jax.jit compile (XLA CPU)")
    ax.set_yticks(list(ys), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("seconds (log)")
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    return _save(fig, path)


def runtime_ratios(rows: list[tuple[str, float]], path: Path) -> Path:
    """(label, stitched program / jax step time) per model and config."""
    fig, ax = plt.subplots(figsize=(6.0, 0.22 * len(rows) + 1.4))
    ax.barh(range(len(rows)), [r[1] for r in rows])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("stitched program (guard off) / jax.jit step time, this CPU (log)")
    ax.tick_params(labelsize=7)
    return _save(fig, path)


def bytes_against_bound(rows: list[tuple[str, float, float, float]], path: Path) -> Path:
    """(label, XLA bytes, stitch bytes, one-kernel bound bytes) per graph and target: both
    plans' memory-intensive bytes as multiples of the one-kernel bound."""
    fig, ax = plt.subplots(figsize=(6.4, 0.24 * len(rows) + 1.4))
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r[1] / r[3] for r in rows], height=0.4, color="tab:red",
            label="XLA")
    ax.barh([y + 0.2 for y in ys], [r[2] / r[3] for r in rows], height=0.4, color="tab:blue",
            label="stitch")
    ax.axvline(1.0, color="black", lw=0.8, label="one-kernel bound")
    ax.set_xlim(0, 1.45 * max(max(r[1], r[2]) / r[3] for r in rows))
    ax.set_yticks(list(ys), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("memory-intensive bytes / one-kernel bound (counted)")
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def planned_vs_delivered(rows: list[tuple[str, float, float, float]], path: Path) -> Path:
    """(step, XLA µs, planned µs, delivered µs) of memory-intensive kernels per step, as a
    fraction of XLA's."""
    fig, ax = plt.subplots(figsize=(6.4, 0.3 * len(rows) + 1.4))
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r[2] / r[1] for r in rows], height=0.4,
            color="tab:gray", label="planned")
    ax.barh([y + 0.2 for y in ys], [r[3] / r[1] for r in rows], height=0.4,
            color="tab:blue", label="delivered")
    ax.axvline(1.0, color="black", lw=0.8, label="XLA")
    ax.set_yticks(list(ys), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.35)
    ax.set_xlabel("memory-intensive µs per step / XLA's (modeled, H100; lower is better)")
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)
