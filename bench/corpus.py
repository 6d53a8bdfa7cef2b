"""XLA's own HLO test modules through every stage of stitch (``python -m bench corpus``).

The corpus (``xla_hlo_corpus.tar.xz``: ``NNNNN.hlo`` files and ``index.json``) holds the HLO
text of XLA's tests and benchmarks. Each module goes through these stages, each in a worker
process under a timeout, so that a crash (XLA's parser aborts on some inputs) or a hang costs
one module, never the run:

* ``xla``       XLA's own parser (``jaxlib._hlo.hlo_module_from_text``): the reference of what
                is valid HLO text;
* ``parse``     ``stitch.hlo.parse_hlo``;
* ``roundtrip`` print -> parse -> print gives the same text;
* ``evaluate``  the reference evaluator on random inputs;
* ``plan``      ``stitch.explorer.graph_plan`` for h100;
* ``compile``   ``stitch.compile`` on the host (poisoned outputs), run on the same inputs,
                compared with the evaluator (modules under ``--size-cap`` characters).

Outcomes per stage: ``ok``, ``StitchError:<class>``, ``exception:<class>`` (a bug),
``wrong`` (compile only), ``undefined`` (compile differs on a module whose result XLA leaves
undefined: a reduction whose init value is not the reducer's identity), ``rounding`` (compile
differs by no more than f32 rounding explains: ``_within_f32_rounding``), ``timeout``,
``crash``, ``skipped`` (an earlier stage failed or the module is over the size cap).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import select
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Iterable

STAGES = ("xla", "parse", "roundtrip", "evaluate", "plan", "compile")
# The shared folder sits beside the checkout (../shared).
DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "xla_hlo_corpus.tar.xz"
_MAX_INPUT_BYTES = 1 << 30
_IDENTITIES = {"add": 0.0, "multiply": 1.0, "maximum": float("-inf"), "minimum": float("inf"),
               "or": 0.0, "and": 1.0}


@dataclasses.dataclass
class ModuleResult:
    file: str
    source: str
    chars: int
    stages: dict[str, str] = dataclasses.field(default_factory=dict)
    details: dict[str, str] = dataclasses.field(default_factory=dict)
    parse_only: bool = False    # the time budget was spent before this module


# --- the worker: runs the stages of one module at a time ------------------------------------
def _random_args(module, rng) -> list:
    import numpy as np
    from stitch.hlo.evaluator.dtypes import numpy_dtype

    def one(shape):
        if shape.is_tuple:
            return tuple(one(s) for s in shape.tuple_shapes)
        if not shape.is_array:
            return np.zeros((0,), np.bool_)
        dtype = numpy_dtype(shape.element_type)
        dims = tuple(max(d, 1) for d in shape.dims)
        kind = np.dtype(dtype).kind
        if kind == "b":
            return rng.random(dims) < 0.5
        if kind in "iu":
            return rng.integers(0, 4, dims).astype(dtype)
        if kind == "c":
            return (rng.standard_normal(dims) + 1j * rng.standard_normal(dims)).astype(dtype)
        return rng.standard_normal(dims).astype(dtype)
    return [one(p.shape) for p in module.entry.parameters]


def _undefined_reduction(module) -> bool:
    """A reduce / reduce-window whose init is not the identity of its reducer (XLA may apply
    the init any number of times, so the result is not defined)."""
    comps = {c.name: c for c in module.computations}
    for comp in module.computations:
        by_name = {i.name: i for i in comp.instructions}
        for inst in comp.instructions:
            if inst.opcode not in ("reduce", "reduce-window"):
                continue
            reducer = comps.get(inst.attrs.get("to_apply", "").lstrip("%"))
            root = next((i for i in reducer.instructions if i.is_root), None) if reducer else None
            identity = _IDENTITIES.get(root.opcode) if root is not None else None
            inits = inst.operands[len(inst.operands) // 2:]
            for name in inits:
                init = by_name.get(name)
                if identity is None or init is None or init.opcode != "constant":
                    return True
                try:
                    value = float(init.literal.strip().replace("true", "1").replace("false", "0"))
                except ValueError:
                    return True
                if value != identity and not (root.opcode in ("maximum", "minimum")
                                              and abs(value) >= 3e38):
                    return True
    return False


def _same(got, want, leaves=None) -> tuple[bool, str]:
    """Outputs equal (floats within a tolerance by width); ``leaves``: the root's leaf
    shapes, whose tokens carry no data and are not compared."""
    import numpy as np
    if len(got) != len(want):
        return False, f"{len(got)} outputs, want {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        if leaves is not None and k < len(leaves) and leaves[k].element_type == "token":
            continue
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return False, f"output {k}: shape {g.shape}, want {w.shape}"
        if w.dtype.kind in "fc" or str(w.dtype) in ("bfloat16",) or w.dtype.itemsize == 1 and \
                w.dtype.kind == "V":
            gf, wf = g.astype(np.complex128 if w.dtype.kind == "c" else np.float64), \
                w.astype(np.complex128 if w.dtype.kind == "c" else np.float64)
            tol = 1e-4 if w.dtype.itemsize >= 4 else 2e-2
            if not np.allclose(gf, wf, rtol=tol, atol=tol, equal_nan=True):
                bad = ~np.isclose(gf, wf, rtol=tol, atol=tol, equal_nan=True)
                return False, f"output {k}: {int(bad.sum())} of {bad.size} elements differ"
        elif not np.array_equal(g, w):
            return False, f"output {k}: {int((g != w).sum())} of {w.size} elements differ"
    return True, ""


def _outcome(exc: BaseException) -> str:
    from stitch.hlo.errors import StitchError
    if isinstance(exc, StitchError):
        return f"StitchError:{type(exc).__name__}"
    return f"exception:{type(exc).__name__}"


def _longest_reduction(module) -> int:
    """The most elements any reduce combines into one output value."""
    longest = 1
    for comp in module.computations:
        by_name = {i.name: i for i in comp.instructions}
        for inst in comp.instructions:
            if inst.opcode != "reduce" or inst.operands[0] not in by_name:
                continue
            dims = by_name[inst.operands[0]].shape
            dims = dims.tuple_shapes[0].dims if dims.is_tuple else dims.dims
            n = 1
            for d in inst.ints("dimensions", ()):
                n *= max(dims[d], 1) if d < len(dims) else 1
            longest = max(longest, n)
    return longest


def _within_f32_rounding(module, text: str, args, got, want) -> bool:
    """The kernels' floats differ from the evaluator's by no more than f32 rounding explains:
    (1) a sum of L terms of standard-normal inputs done in another order than numpy's
    pairwise sum is off by about eps * sqrt(L) * its magnitude (4x that is allowed); (2)
    elements where the evaluator itself, run in f64 (every f32 of the module made f64),
    disagrees with its f32 run are not determined at f32 precision (log(log(s)) at s ~ 1)
    and are not compared. Anything else is a wrong result."""
    import numpy as np

    from stitch.hlo import evaluate, parse_hlo
    if "f32" not in text or any(t in text for t in ("f64", "bitcast-convert", "f16", "bf16")):
        return False
    try:
        wide = parse_hlo(text.replace("f32[", "f64["))
        args64 = [a.astype(np.float64) if getattr(a, "dtype", None) == np.float32 else a
                  for a in args]
        want64 = evaluate(wide, args64)
    except Exception:  # noqa: BLE001 - no f64 twin: cannot tell, so it stays wrong
        return False
    slack = 4 * float(np.finfo(np.float32).eps) * np.sqrt(_longest_reduction(module))
    for g, w, w64 in zip(got, want, want64):
        g, w, w64 = (np.asarray(x) for x in (g, w, w64))
        if w.dtype != np.float32 or g.shape != w.shape or w64.shape != w.shape:
            if not np.array_equal(g, w):
                return False
            continue
        g, w, w64 = g.astype(np.float64), w.astype(np.float64), w64.astype(np.float64)
        determined = np.isclose(w, w64, rtol=1e-4, atol=1e-4, equal_nan=True)
        finite = np.abs(w[determined & np.isfinite(w)])
        atol = 1e-4 + slack * (finite.max() if finite.size else 0.0)
        if not np.allclose(g[determined], w[determined], rtol=1e-4, atol=atol, equal_nan=True):
            return False
    return True


def _worker_stages(text: str, stages: Iterable[str], emit, compile_ok: bool) -> None:
    import numpy as np
    module = args = expected = None
    for stage in stages:
        emit({"stage": stage, "start": True})
        try:
            if stage == "xla":
                from jaxlib import _hlo
                _hlo.hlo_module_from_text(text)
            elif stage == "parse":
                from stitch.hlo import parse_hlo
                module = parse_hlo(text)
            elif module is None:
                emit({"stage": stage, "outcome": "skipped"})
                continue
            elif stage == "roundtrip":
                from stitch.hlo import parse_hlo, print_hlo
                once = print_hlo(module)
                twice = print_hlo(parse_hlo(once))
                if once != twice:
                    emit({"stage": stage, "outcome": "wrong", "detail": "print(parse(print)) differs"})
                    continue
            elif stage == "evaluate":
                from stitch.hlo import evaluate
                size = sum(p.shape.byte_size for p in module.entry.parameters)
                if size > _MAX_INPUT_BYTES:  # XLA's tests name shapes no host holds
                    emit({"stage": stage, "outcome": "skipped",
                          "detail": f"inputs of {size / 2**20:.0f} MiB"})
                    continue
                args = _random_args(module, np.random.default_rng(1234))
                expected = evaluate(module, args)
            elif stage == "plan":
                from stitch.explorer.planner import plan
                plan(module, "h100")
            elif stage == "compile":
                if not compile_ok or expected is None:
                    emit({"stage": stage, "outcome": "skipped"})
                    continue
                import stitch
                exe = stitch.compile(module, "h100", "cpu", cache=False, poison_outputs=True)
                got = exe(*args)
                ok, why = _same(got, expected, list(module.entry.root.shape.leaves()))
                if not ok:
                    if _undefined_reduction(module):
                        outcome = "undefined"
                    elif _within_f32_rounding(module, text, args, got, expected):
                        outcome, why = "rounding", f"f32 rounding ({why})"
                    else:
                        outcome = "wrong"
                    emit({"stage": stage, "outcome": outcome, "detail": why})
                    continue
        except BaseException as exc:  # noqa: BLE001 - every failure is a result here
            if stage == "parse":
                module = None
            if stage == "evaluate":
                expected = None
            emit({"stage": stage, "outcome": _outcome(exc), "detail": str(exc)[:300]})
            continue
        emit({"stage": stage, "outcome": "ok"})


def worker_main() -> None:
    """Read one JSON request per line on stdin, answer with one JSON line per stage event."""
    import logging
    logging.disable(logging.WARNING)
    out = sys.stdout
    # Import everything up front: the per-stage timeouts are for the stages, not imports.
    import stitch  # noqa: F401
    import stitch.explorer.planner  # noqa: F401
    from stitch.hlo import evaluate  # noqa: F401
    from jaxlib import _hlo  # noqa: F401

    def emit(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()
    emit({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        text = Path(request["path"]).read_text()
        _worker_stages(text, request["stages"], emit, request["compile"])
        emit({"done": True})


# --- the driver -----------------------------------------------------------------------------
class _Worker:
    def __init__(self):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.corpus", "--worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
            cwd=str(Path(__file__).resolve().parent.parent))
        self.fd = self.proc.stdout.fileno()
        self.buffer = b""  # read with os.read: a buffered reader hides lines from select
        self.readline(300.0)  # the "ready" line: imports done

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def readline(self, timeout: float) -> dict | None:
        """The next event, None on timeout; {"eof": True} when the worker died."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], max(left, 0))
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return {"eof": True}
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def run_corpus(corpus: Path, stages: tuple[str, ...], limit: int | None, size_cap: int,
               timeout: float, progress=None, only: set[str] | None = None,
               max_chars: int = 1_500_000, budget: float | None = None) -> list[ModuleResult]:
    """Every module through ``stages``. ``budget`` (seconds): the modules go in a seeded
    random order, and once the budget is spent the rest get only the parse stages (so the
    fully run ones are a random sample and the parse coverage still covers everything)."""
    root = _unpack(corpus)
    modules = json.loads((root / "index.json").read_text())["modules"]
    if only:
        modules = [m for m in modules if m["file"] in only]
    if limit:
        modules = modules[:limit]
    if budget is not None:
        import random
        modules = sorted(modules, key=lambda m: random.Random(m["id"]).random())
    results: list[ModuleResult] = []
    worker = _Worker()
    start = time.perf_counter()
    try:
        for n, m in enumerate(modules):
            r = ModuleResult(m["file"], m["source"], m["chars"])
            results.append(r)
            over_budget = budget is not None and time.perf_counter() - start > budget
            if m["chars"] > max_chars or over_budget:  # multi-MB models, or out of time
                todo = [s for s in stages if s in ("xla", "parse")]
                r.parse_only = over_budget
            else:
                todo = list(stages)
            request = {"path": str(root / m["file"]), "stages": todo,
                       "compile": m["chars"] <= size_cap}
            worker.proc.stdin.write(json.dumps(request) + "\n")
            worker.proc.stdin.flush()
            current = None
            while True:
                event = worker.readline(timeout)
                if event is None or event.get("eof"):
                    hung = current or (todo[0] if todo else "parse")
                    r.stages[hung] = "timeout" if event is None else "crash"
                    worker.kill()
                    worker = _Worker()
                    break
                if event.get("done"):
                    break
                if "outcome" in event:
                    current = None
                    r.stages[event["stage"]] = event["outcome"]
                    if event.get("detail"):
                        r.details[event["stage"]] = event["detail"]
                else:
                    current = event["stage"]
            for s in stages:
                r.stages.setdefault(s, "skipped")
            if progress and (n + 1) % 200 == 0:
                progress(f"corpus: {n + 1}/{len(modules)} modules, "
                         f"{time.perf_counter() - start:.0f} s")
    finally:
        worker.kill()
    return results


def _unpack(corpus: Path) -> Path:
    if corpus.is_dir():
        return corpus
    target = Path(os.environ.get("TMPDIR", "/tmp")) / f"stitch-corpus-{os.getuid()}"
    root = target / "xla_hlo_corpus"
    if not (root / "index.json").exists():
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(corpus) as tar:
            tar.extractall(target, filter="data")
    return root


def _bucket(outcome: str) -> str:
    return outcome.split(":")[0] if outcome.startswith("exception") else outcome


def summary_markdown(results: list[ModuleResult], stages: tuple[str, ...], args_line: str,
                     seconds: float) -> list[str]:
    sampled = [r for r in results if r.parse_only]
    scope = (f" Under the time budget {len(results) - len(sampled)} modules (a seeded random "
             f"sample) went through every stage, the other {len(sampled)} through the parse "
             "stages only (their later stages count as skipped)." if sampled else "")
    lines = [f"{len(results)} modules; run time {seconds:.0f} s (measured). Outcomes counted "
             "per stage; a stage runs only where the previous one succeeded; compile + run "
             "only for modules within the size cap." + scope, "",
             "| stage | ok | StitchError (by class) | other exception | wrong | "
             "undefined (excepted) | f32 rounding (excepted) | timeout | crash | skipped |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    notes = ["", "Row `xla` is XLA's own parser: its exceptions, timeouts and crashes (a CHECK "
             "failure aborts the worker) are the modules XLA rejects, the reference for parse "
             "coverage; they are not stitch failures."]
    for s in stages:
        c = collections.Counter(r.stages.get(s, "skipped") for r in results)
        errors = collections.Counter(o.split(":", 1)[1] for o in c.elements()
                                     if o.startswith("StitchError:"))
        other = sum(v for k, v in c.items() if k.startswith("exception:"))
        err_text = ", ".join(f"{k} {v}" for k, v in errors.most_common()) or "0"
        lines.append(f"| {s} | {c['ok']} | {err_text} | {other} | {c['wrong']} | "
                     f"{c['undefined']} | {c['rounding']} | {c['timeout']} | {c['crash']} | "
                     f"{c['skipped']} |")
    if "xla" in stages:
        lines += notes
    if "xla" in stages and "parse" in stages:
        xla_ok = [r for r in results if r.stages["xla"] == "ok"]
        both = sum(r.stages["parse"] == "ok" for r in xla_ok)
        extra = sum(r.stages["parse"] == "ok" and r.stages["xla"] != "ok" for r in results)
        if xla_ok:
            lines += ["", f"**Parse coverage**: stitch reads {both} of the {len(xla_ok)} modules "
                      f"XLA's parser reads ({100 * both / len(xla_ok):.1f}%); it also reads "
                      f"{extra} modules XLA rejects."]
    rank = {"wrong": 0, "crash": 1, "undefined": 3, "rounding": 3, "timeout": 4}
    listed = sorted(((r, s) for r in results for s in stages if s != "xla" and (
        r.stages.get(s, "").startswith("exception") or r.stages.get(s) in rank)),
        key=lambda rs: rank.get(rs[0].stages[rs[1]], 2))  # wrong results first
    if listed:
        lines += ["", "Modules with another exception, a wrong or undefined result, a timeout "
                  "or a crash (stage: outcome — detail):", ""]
        for r, s in listed[:80]:
            detail = r.details.get(s, "").replace("\n", " ").replace("|", "\\|")[:160]
            lines.append(f"- `{r.file}` ({r.source}) {s}: {r.stages[s]} — {detail}")
        if len(listed) > 80:
            lines.append(f"- ... and {len(listed) - 80} more")
    if "parse" in stages and "xla" in stages:
        rejected = collections.Counter(
            r.details.get("parse", "").split("\n")[0].split(": ", 1)[-1][:70]
            for r in results if r.stages["xla"] == "ok" and r.stages["parse"] != "ok")
        if rejected:
            lines += ["", "What stitch rejects among the modules XLA reads (first line of the "
                      "error, most common first):", ""]
            lines += [f"- {v} × {k}" for k, v in rejected.most_common(15)]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.corpus", description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    add_arguments(parser)
    parser.add_argument("--json", type=Path, help="write every module's outcomes here")
    args = parser.parse_args(argv)
    if args.worker:
        worker_main()
        return
    stages = tuple(args.stages)
    start = time.perf_counter()
    results = run_corpus(args.corpus, stages, args.limit, args.size_cap, args.timeout,
                         progress=lambda s: print(s, file=sys.stderr, flush=True),
                         budget=args.budget)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=0))
    print("\n".join(summary_markdown(results, stages, "", time.perf_counter() - start)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                        help="the corpus tarball or its unpacked directory")
    parser.add_argument("--limit", type=int, help="only the first N modules")
    parser.add_argument("--stages", type=lambda s: tuple(s.split(",")), default=STAGES,
                        help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--size-cap", type=int, default=4000,
                        help="compile + run only modules of at most this many characters")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per stage")
    parser.add_argument("--budget", type=float,
                        help="seconds for the full stages; then parse stages only (random order)")

def _run_part(ctx) -> list[str]:
    args = ctx.args
    limit = args.limit or (20 if ctx.quick else None)
    start = time.perf_counter()
    results = run_corpus(args.corpus, tuple(args.stages), limit, args.size_cap, args.timeout,
                         progress=lambda s: print(s, file=sys.stderr, flush=True),
                         budget=args.budget)
    return summary_markdown(results, tuple(args.stages), "", time.perf_counter() - start)


def _measure():
    from bench.measure import Measure, Part
    return Measure(
        name="corpus",
        title="XLA's own test modules through every stage (counted outcomes)",
        summary="XLA's HLO test corpus (shared/xla_hlo_corpus.tar.xz) through parse, round "
                "trip, evaluate, plan and compile + run, each stage under a timeout. About "
                "10 minutes in full; `--limit N` or `--quick` (20 modules) for a short run.",
        parts=(Part("stages", "Outcomes per stage", _run_part),),
        arguments=add_arguments)


MEASURE = _measure()

if __name__ == "__main__":
    main()
