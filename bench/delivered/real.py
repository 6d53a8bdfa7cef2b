"""Real-size training steps through the pass (deviceless H100): delivered, whole step, memory.

``python -m bench.delivered.real [--steps 'NAME;...'] [--out docs/benchmarks.md]``

Each row of ``bench.real_steps.REAL_STEPS`` (GPT-2 small at 1/12/48 layers, f32 and bf16 at
12, the Llama-style step) is lowered with its parameters and optimizer state donated and
compiled for an H100 without a device twice in one child process (the venv with jax's CUDA
plugin, ``bench/delivered/children.py``): stock XLA, then with stitch's pass. Per row:

- modeled (stitch's delta cost model, ``stitch/xla_pass/delivered.py``): memory-intensive
  µs of XLA's module and of the module the pass returns, the share of the plan's saving
  delivered, and the whole step (GEMMs at the target's tensor-core rate on both sides,
  ``stitch/cost/gemm_rates.py``);
- counted: HBM bytes of the memory-intensive kernels as the model counts them, compile
  seconds (wall clock on this shared machine: ratios, not absolutes), XLA's buffer
  assignment of each final module (``compiled.memory_analysis()``: arguments, outputs,
  aliased and temporary bytes), and the f32 ``[B,H,S,S]`` / ``[B,S,vocab]`` buffers the
  stitched module still materializes (read from its final HLO).
The pass runs inside XLA before buffer assignment, so peak memory is read here, from the
compiled executables.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

SECTION = "bench-delivered-real-rows"
MARK = "REAL "
# Instructions whose result is no buffer of its own (an alias of another, or an input).
_NO_BUFFER = frozenset({"bitcast", "get-tuple-element", "tuple", "parameter", "constant"})


def peak_memory(compiled) -> dict:
    """XLA's buffer assignment of a compiled executable (counted): arguments + outputs +
    temporaries − what outputs alias of the arguments (donation)."""
    m = compiled.memory_analysis()
    args, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
    alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
    return {"args": args, "outputs": out, "alias": alias, "temp": temp,
            "peak": args + out + temp - alias}


# Float types a scores- or logits-sized buffer is counted in (bf16 steps store theirs so).
_FLOATS = frozenset({"f32", "bf16", "f16"})
# The module's kernels moving the most HBM bytes, per row.
MOVERS = 8
# Where the attention backward is placed: "priced" (the pass's default, by its model) or
# "always" (wherever it fits); the child reads it from the environment.
PLACEMENT_ENV = "STITCH_BENCH_BACKWARD_PLACEMENT"


def value_shapes(hlo_text: str) -> dict[str, str]:
    """Top-level instruction name -> its result shape, as printed."""
    from stitch.hlo.parser import parse_hlo

    module = parse_hlo(hlo_text)
    return {inst.name: str(inst.shape) for inst in module.entry.instructions}


def largest_movers(delivery, shapes: dict[str, str], count: int = MOVERS) -> list[list]:
    """[name, stitched, memory-intensive, GB, µs, tops, their shapes (first 3)] of the
    delivered module's kernels moving the most HBM bytes (``Delivery.largest_movers``);
    shapes from XLA's module (the pass gets it with the same names)."""
    out = []
    for m in delivery.largest_movers(count):
        out.append([m.name, m.stitched, m.memory, round(m.hbm_bytes / 1e9, 3),
                    round(m.modeled_us, 1), len(m.tops),
                    [f"{t} {shapes.get(t, '?')[:80]}" for t in m.tops[:3]]])
    return out


def big_buffers(hlo_text: str, dims: dict[str, tuple[int, ...]]) -> dict[str, list[int]]:
    """Per name in ``dims``: the byte sizes of the float buffers with that many elements (any
    view of them: XLA bitcasts ``[B,H,S,S]`` to ``[B·H,S,S]``) that the module's
    non-fusion computations (entry, loop bodies, branches) materialize."""
    import math

    from stitch.hlo.parser import parse_hlo

    module = parse_hlo(hlo_text)
    fused = {c for comp in module.computations for inst in comp.instructions
             if inst.opcode in ("fusion", "reduce", "sort", "scatter", "map",
                                "reduce-window", "select-and-scatter", "all-reduce",
                                "reduce-scatter", "custom-call")
             for c in inst.called_computations}
    wanted = {name: math.prod(d) for name, d in dims.items()}
    found: dict[str, list[int]] = {name: [] for name in dims}
    for comp in module.computations:
        if comp.name in fused:
            continue
        for inst in comp.instructions:
            if inst.opcode in _NO_BUFFER:
                continue
            shapes = inst.shape.leaves() if inst.shape.is_tuple else [inst.shape]
            for s in shapes:
                if not s.is_array or s.element_type not in _FLOATS:
                    continue
                for name, elements in wanted.items():
                    if s.num_elements == elements:
                        found[name].append(s.byte_size)
    return found


def measure_one(name: str) -> dict:
    """In the deviceless venv: one REAL_STEPS row, compiled stock and with the pass."""
    from bench.real_steps import REAL_STEPS, lower_for
    from stitch.xla_pass import deviceless

    deviceless.check_environment()
    placement = os.environ.get(PLACEMENT_ENV)
    if placement:
        from stitch.xla_pass import attention_backward_jobs
        attention_backward_jobs.PLACEMENT = placement
    cfg = next(c for c in REAL_STEPS if c.name == name)
    start = time.perf_counter()
    lowered = lower_for(cfg, "h100")
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    stock = lowered.compile()
    stock_s = time.perf_counter() - start
    stock_mem = peak_memory(stock)
    dims = {"scores": (cfg.batch, cfg.heads, cfg.seq, cfg.seq),
            "logits": (cfg.batch, cfg.seq, cfg.vocab)}
    stock_text = stock.as_text()
    stock_left = big_buffers(stock_text, dims)
    del stock
    start = time.perf_counter()
    result = deviceless.compile_with_pass(lowered, name, "h100")
    stitched_s = time.perf_counter() - start
    report = result.report
    left = big_buffers(result.compiled.as_text(), dims)
    import jax
    return {"step": name + (f" (attention backward: {placement})" if placement else ""),
            "jax": jax.__version__, **report.summary(),
            "movers": largest_movers(report.delivery, value_shapes(stock_text))
            if report.delivery is not None else [],
            "lower_s": round(lower_s, 1), "xla_compile_s": round(stock_s, 1),
            "stitched_compile_s": round(stitched_s, 1),
            "stock_memory": stock_mem, "stitched_memory": peak_memory(result.compiled),
            "left": left, "stock_left": stock_left,
            "dropped": [[k.name, k.kind, round(k.planned_saving_us, 1), k.reason[:200]]
                        for k in sorted(report.delivery.dropped,
                                        key=lambda k: -k.planned_saving_us)[:5]]
            if report.delivery is not None else []}


def collect(names: list[str], timeout: float = 1800.0) -> list[dict]:
    from bench.delivered.children import run_one
    return [run_one("bench.delivered.real", name, MARK, "step", timeout) for name in names]


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _left(row: dict) -> str:
    """Per kind, stock → stitched counts (and the largest buffer's MB)."""
    parts = []
    stock = row.get("stock_left", {})
    for name, sizes in row["left"].items():
        before = stock.get(name, [])
        if sizes or before:
            largest = max(sizes or before) / 1e6
            parts.append(f"{name} {len(before)} → {len(sizes)} ({largest:,.0f} MB each at most)")
    return ", ".join(parts) or "none"


def markdown(rows: list[dict], command: str) -> str:
    from bench.report import stamp
    versions = sorted({r["jax"] for r in rows if "jax" in r})
    children = (f"The children run jax {', '.join(versions)} (the deviceless venv, "
                f"STITCH_CUDA_VENV). " if versions else "")
    lines = ["## Real-size training steps through the pass (deviceless H100)", "",
             stamp(command, os.getloadavg()), "",
             children + "Rows: `bench/real_steps.py` (plain JAX, AdamW by hand, parameters and optimizer "
             "state donated), each compiled for an H100 without a device, stock and with "
             "stitch's pass, in one child process. **Modeled** (stitch's delta cost model, "
             "stitch/xla_pass/delivered.py): *mem µs* (memory-intensive kernels, XLA's "
             "module → the module the pass returns), *share* (of the plan's saving, what "
             "reached the module; above 100% where the pass also places kernels outside the "
             "plan: attention backwards, LM head losses), *whole step* (every kernel, GEMMs at the H100's "
             "achievable tensor-core rate for their operand type and precision on both "
             "sides: stitch/cost/gemm_rates.py; *GEMMs*: XLA's whole step less its "
             "memory-intensive kernels, i.e. its GEMM kernels). **Counted**: *mem bytes* "
             "(HBM bytes of the "
             "memory-intensive kernels as the model counts them, delivered / XLA), *compile "
             "s* (wall clock, stock / with the pass; the machine is shared: ratios, not "
             "absolutes), *peak* (XLA's buffer assignment of each final module, "
             "`compiled.memory_analysis()`: arguments + outputs + temporaries − aliased), "
             "*alias* (output bytes aliased to donated inputs), *[B,H,S,S] / [B,S,V] "
             "buffers* (buffers of that many f32/bf16/f16 elements the entry and loop bodies "
             "materialize, stock → stitched, from each final HLO).", "",
             "| step | mem µs, XLA → delivered | share | mem bytes, delivered / XLA | "
             "whole step ms, XLA → stitch | compile s, XLA / stitched | peak GB, stock / "
             "stitched | alias GB, stock / stitched | [B,H,S,S] / [B,S,V] buffers |",
             "|---|---|---:|---:|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['step']} | {r['error']} ||||||||")
            continue
        share = "–" if r["delivered_share"] is None else f"{r['delivered_share']:.0%}"
        sm, tm = r["stock_memory"], r["stitched_memory"]
        lines.append(
            f"| {r['step']} | {r['xla_mem_us']:,.0f} → {r['delivered_mem_us']:,.0f} "
            f"({r['xla_mem_us'] / max(r['delivered_mem_us'], 1e-9):.2f}×) | {share} | "
            f"{r['delivered_mem_bytes'] / max(r['xla_mem_bytes'], 1):.2f} | "
            f"{r['xla_us'] / 1e3:,.1f} → {r['delivered_us'] / 1e3:,.1f} "
            f"({r['xla_us'] / max(r['delivered_us'], 1e-9):.2f}×; GEMMs "
            f"{(r['xla_us'] - r['xla_mem_us']) / 1e3:,.1f}) | "
            f"{r['xla_compile_s']:.1f} / {r['stitched_compile_s']:.1f} | "
            f"{_gb(sm['peak'])} / {_gb(tm['peak'])} | {_gb(sm['alias'])} / "
            f"{_gb(tm['alias'])} | {_left(r)} |")
    unaliased = [r["step"] for r in rows if "error" not in r
                 and r["stock_memory"]["alias"] > 0 and r["stitched_memory"]["alias"] == 0]
    if unaliased:
        lines += ["", "The stitched modules alias no output to a donated input ("
                  + ", ".join(unaliased) + "): jaxlib before 0.11 drops `input_output_alias` "
                  "from every module its transformation hook hands back (tests/deviceless/"
                  "test_gpu_deviceless.py), so their peak counts the donated state twice."]
    movers = [(r["step"], r["movers"]) for r in rows if "error" not in r and r.get("movers")]
    if movers:
        lines += ["", f"The stitched modules' largest HBM movers (modeled bytes per step, up to "
                  f"{MOVERS} per step; *S* a stitch kernel, *X* XLA's, *mem* memory-intensive; "
                  "instructions it is or replaces, shapes from XLA's module):", ""]
        for step, rows_of in movers:
            lines.append(f"- {step}: " + "; ".join(
                f"{name} ({'S' if st else 'X'}{' mem' if mem else ''}, {gb:.2f} GB, "
                f"{us:,.0f} µs; {n} instr., e.g. `{tops[0] if tops else '-'}`)"
                for name, st, mem, gb, us, n, tops in rows_of))
    drops = [(r["step"], d) for r in rows if "error" not in r for d in r.get("dropped", [])
             if d[2] >= 1.0]
    if drops:
        lines += ["", "Planned kernels that did not reach the module (largest planned saving "
                  "first, up to 5 per step):", ""]
        lines += [f"- {step}: {name} ({kind}, {saving:,.0f} µs): {reason}"
                  for step, (name, kind, saving, reason) in drops]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.delivered.real",
                                     description=__doc__.split("\n")[0])
    # Step names hold commas ("GPT-2 small, 12 layers"): the list is ;-separated.
    parser.add_argument("--steps", help="REAL_STEPS names separated by ';'")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--backward-placement", choices=("priced", "always"),
                        help="place attention backwards by the pass's model (its default) "
                             "or wherever they fit")
    args = parser.parse_args(argv)
    if args.backward_placement:
        os.environ[PLACEMENT_ENV] = args.backward_placement
    if args.one:
        print(MARK + json.dumps(measure_one(args.one)), flush=True)
        return
    from bench.real_steps import REAL_STEPS
    names = [n.strip() for n in args.steps.split(";")] if args.steps else [c.name for c in REAL_STEPS]
    text = markdown(collect(names), "python -m bench.delivered.real"
                    + (f" --steps '{args.steps}'" if args.steps else "")
                    + (f" --backward-placement {args.backward_placement}"
                       if args.backward_placement else ""))
    if args.out:
        from bench.report import write_section
        write_section(args.out, SECTION, text)
    else:
        print(text)


if __name__ == "__main__":
    main()
