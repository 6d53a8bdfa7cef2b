"""The kit's ``tensor_cores`` step: stitch's GEMM-bound kernels timed on the device at real
sizes, to calibrate the fractions of peak the pricing assumes
(``stitch.cost.mma_efficiency``).

    python -m bench.gpu_kit.tensor_cores --out DIR [--cases name,...] [--rehearse]

Per case (``CASES``): the kernel is lowered, emitted and assembled here on the device
(ptxas for its arch), its inputs drawn from a seeded RNG, launched through
``bench.cuda_driver`` (a launch per phase), its outputs read back and checked against jax
on the device — ``jax.vjp`` of the same math in float32 at HIGHEST precision, from the very
values the kernel read — at the case's tolerance (max |kernel − jax| / max |jax| per
output), then timed as CUDA graph replays (``bench.opt_levels.graph_time_us``). XLA's time
for the same math is ``jax.jit`` of the vjp (of the forward for the chain) on inputs of
the kernel's storage type, at the precision the kernel's unit stands for (HIGHEST for the
f32 FMA case, else DEFAULT: TF32 / bf16 GEMMs): XLA's GEMMs and fusions. Each row gets the
kernel's flops (``tensor_flops``), achieved TFLOP/s and its fraction of the target's peak
for its unit (``stitch.cost.gemm_rates.peak_flops``). A case whose check fails is written
with ``correct: false`` (the step then fails; ingest never calibrates from it).

Writes ``<out>/tensor_cores.json`` after every case (a timeout keeps what was measured).
With ``--rehearse`` (no GPU) it writes a record saying so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .tensor_flops import (attention_backward_flops, gemm_chain_flops, lm_head_backward_flops,
                           rates)

SEED = 20261129
# max |kernel - jax| / max |jax| per output, by the unit the kernel's GEMMs run on.
TOLERANCE = {"f32": 1e-4, "tf32": 1e-2, "f16/bf16": 3e-2}
XLA_CALLS = 5          # timed jax.jit calls per repeat (after two warm-up calls)
XLA_REPEATS = 3
TARGET_GRAPH_MS = 20   # replays per captured graph: about this long a replay
REPEATS = 5
CHAIN_FIXTURE = Path(__file__).resolve().parents[2] / "hlo_fixtures" / "data" / \
    "attention_bert_base" / "full.gpu-h100.hlo"


@dataclass(frozen=True)
class Case:
    name: str
    kind: str            # attention_backward | lm_head_backward | gemm_chain
    dtype: str           # storage type of the operands
    tf32: bool           # f32 operands on TF32 tensor cores
    sizes: dict


CASES = (        # most wanted first: the step may run out of time
    Case("gpt2_attention_bwd_bf16", "attention_backward", "bf16", False,
         {"batch": 96, "length": 1024, "head_dim": 64, "causal": True}),
    Case("gpt2_lm_head_bwd_bf16", "lm_head_backward", "bf16", False,
         {"rows": 8192, "vocab": 50257, "hidden": 768}),
    Case("gpt2_attention_bwd_tf32", "attention_backward", "f32", True,
         {"batch": 96, "length": 1024, "head_dim": 64, "causal": True}),
    Case("llama_attention_bwd_bf16", "attention_backward", "bf16", False,
         {"batch": 64, "length": 2048, "head_dim": 128, "causal": True}),
    Case("gpt2_attention_chain_tf32", "gemm_chain", "f32", True,
         {"batch": 96, "length": 1024, "head_dim": 64}),
    Case("gpt2_attention_bwd_f32", "attention_backward", "f32", False,
         {"batch": 96, "length": 1024, "head_dim": 64, "causal": True}),
)


@dataclass
class Built:
    """A lowered kernel and what the step needs to run and price it."""
    kernel: Any
    flops: float
    unit: str
    inputs: dict            # param name -> host numpy array (storage type)
    reference: Callable     # () -> {output name: float32 numpy array} (jax on the device)
    xla: Callable           # () -> a jitted call's result (timed)
    notes: str = ""


# ------------------------------------------------------------------ host values

def _storage(values, dtype: str):
    """float32 ``values`` as the kernel stores them (bf16 through ml_dtypes)."""
    import ml_dtypes
    import numpy as np
    return values.astype(np.float32 if dtype == "f32" else ml_dtypes.bfloat16)


def _f32(values):
    import numpy as np
    return np.asarray(values, dtype=np.float32)


# ------------------------------------------------------------------ the cases

def _attention(case: Case, arch: str) -> Built:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from stitch.codegen.attention_backward import (AttentionBackward, BackwardTiling,
                                                   lower_attention_backward,
                                                   uses_tensor_cores)
    s = case.sizes
    b, n, d = s["batch"], s["length"], s["head_dim"]
    scale = 1.0 / math.sqrt(d)
    problem = AttentionBackward(b, n, n, d, scale, s["causal"], case.dtype)
    mma = uses_tensor_cores(problem, arch, case.tf32)
    tiling = BackwardTiling.default_for(problem, two_results=True, mma=mma)
    kernel = lower_attention_backward(problem, tiling, "attention_backward", arch, case.tf32)
    rng = np.random.default_rng(SEED)
    inputs = {name: _storage(rng.standard_normal((b, n, d), np.float32), case.dtype)
              for name in ("q", "k", "v", "d_o")}
    flops = attention_backward_flops(b, n, d, s["causal"], tiling.block_rows,
                                     tiling.block_cols, tiling.block_h)
    unit = ("f16/bf16" if case.dtype != "f32" else "tf32") if mma else "f32"

    def forward(q, k, v, precision):
        scores = jnp.einsum("bqd,bkd->bqk", q, k, precision=precision) * scale
        if s["causal"]:
            mask = jnp.tril(jnp.ones((n, n), bool))
            scores = jnp.where(mask, scores, -jnp.inf)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
        return jnp.einsum("bqk,bkd->bqd", probs, v, precision=precision)

    def backward(q, k, v, d_o, precision):
        _, pullback = jax.vjp(lambda *a: forward(*a, precision), q, k, v)
        return pullback(d_o)

    def reference():
        args = [jnp.asarray(_f32(inputs[x])) for x in ("q", "k", "v", "d_o")]
        got = jax.jit(lambda *a: backward(*a, jax.lax.Precision.HIGHEST))(*args)
        return {name: np.asarray(value) for name, value in zip(("dq", "dk", "dv"), got)}

    xla_precision = jax.lax.Precision.HIGHEST if unit == "f32" else jax.lax.Precision.DEFAULT
    xla_args = [jnp.asarray(inputs[x]) for x in ("q", "k", "v", "d_o")]
    xla_fn = jax.jit(lambda *a: backward(*a, xla_precision))
    return Built(kernel, flops, unit, inputs, reference, lambda: xla_fn(*xla_args),
                 f"tiles {tiling.block_rows}x{tiling.block_cols}, head blocks of "
                 f"{tiling.block_h}")


def _lm_head(case: Case, arch: str) -> Built:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from stitch.codegen.lm_head_backward import (LmHeadBackward, default_tiling,
                                                 lower_lm_head_backward, recompute_factor,
                                                 uses_tensor_cores)
    s = case.sizes
    rows, vocab, hidden = s["rows"], s["vocab"], s["hidden"]
    problem = LmHeadBackward(rows, vocab, hidden, case.dtype, tf32=case.tf32)
    mma = uses_tensor_cores(problem, arch, case.tf32)
    tiling = default_tiling(problem, mma)
    kernel = lower_lm_head_backward(problem, tiling, "lm_head_backward", arch, case.tf32)
    rng = np.random.default_rng(SEED)
    # Hidden states and embeddings at a trained model's scale (logits of order 1).
    h = _storage(rng.standard_normal((rows, hidden), np.float32), case.dtype)
    emb = _storage(rng.standard_normal((vocab, hidden), np.float32) / math.sqrt(hidden),
                   case.dtype)
    labels = rng.integers(0, vocab, rows).astype(np.int32)
    g = (rng.uniform(0.5, 1.5, rows) / rows).astype(np.float32)

    def logits(hh, ee, precision):
        return jnp.einsum("rd,vd->rv", hh, ee, precision=precision,
                          preferred_element_type=jnp.float32)

    highest = jax.lax.Precision.HIGHEST
    lse = np.asarray(jax.jit(lambda hh, ee: jax.nn.logsumexp(logits(hh, ee, highest), -1))(
        jnp.asarray(_f32(h)), jnp.asarray(_f32(emb))))
    inputs = {"h": h, "emb": emb, "labels": labels, "lse": lse.astype(np.float32), "g": g}
    unit = ("f16/bf16" if case.dtype != "f32" else "tf32") if mma else "f32"

    def loss_rows(hh, ee, precision):
        s_ = logits(hh, ee, precision)
        picked = jnp.take_along_axis(s_, jnp.asarray(labels)[:, None], axis=-1)[:, 0]
        return jax.nn.logsumexp(s_, axis=-1) - picked

    def backward(hh, ee, gg, precision):
        _, pullback = jax.vjp(lambda a, c: loss_rows(a, c, precision), hh, ee)
        return pullback(gg)

    def reference():
        got = jax.jit(lambda a, c, gg: backward(a, c, gg, highest))(
            jnp.asarray(_f32(h)), jnp.asarray(_f32(emb)), jnp.asarray(g))
        return {"dh": np.asarray(got[0]), "demb": np.asarray(got[1])}

    xla_precision = highest if unit == "f32" else jax.lax.Precision.DEFAULT
    xla_args = (jnp.asarray(h), jnp.asarray(emb), jnp.asarray(g))
    xla_fn = jax.jit(lambda a, c, gg: backward(a, c, gg, xla_precision))
    recompute = recompute_factor(problem, tiling)
    return Built(kernel, lm_head_backward_flops(rows, vocab, hidden, recompute), unit, inputs,
                 reference, lambda: xla_fn(*xla_args),
                 f"logits computed {recompute}x per phase")


def chain_text(batch: int, length: int, head_dim: int) -> str:
    """The BERT-base attention fixture (softmax(Q K^T / 8) V, f32, XLA's H100 fusions) at
    other sizes: its shapes substituted in the text (d stays 64: the scale is its)."""
    if head_dim != 64:
        raise ValueError("the chain fixture's scale is for a head dim of 64")
    text = CHAIN_FIXTURE.read_text()
    return (text.replace("12,512,512", f"{batch},{length},{length}")
            .replace("12,512,64", f"{batch},{length},{head_dim}")
            .replace("12,512]", f"{batch},{length}]"))


def _chain(case: Case, arch: str) -> Built:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from stitch.codegen.gemm_chain import ChainTiling, lower_gemm_chain
    from stitch.hlo.gemm_chains import find_gemm_chains
    from stitch.hlo.graph import build_op_graphs
    from stitch.hlo.parser import parse_hlo
    from stitch.models.blocks import scaled_dot_attention

    s = case.sizes
    graph = build_op_graphs(parse_hlo(chain_text(s["batch"], s["length"], s["head_dim"])))[0]
    (chain,) = find_gemm_chains(graph)
    tiling = ChainTiling.default_for(chain, arch, allow_tf32=case.tf32)
    lowered = lower_gemm_chain(graph, chain, tiling, "gemm_chain", arch)
    rng = np.random.default_rng(SEED)
    args = [_storage(rng.standard_normal((s["batch"], s["length"], s["head_dim"]), np.float32),
                     case.dtype) for _ in range(3)]
    params = lowered.kernel.params
    inputs = {p.name: args[graph.nodes[v].instruction.parameter_number]
              for p, v in zip(params, lowered.inputs)}
    out_name = params[-1].name

    def reference():
        with jax.default_matmul_precision("highest"):
            got = jax.jit(scaled_dot_attention)(*[jnp.asarray(_f32(a)) for a in args])
        return {out_name: np.asarray(got)}

    xla_args = [jnp.asarray(a) for a in args]
    xla_fn = jax.jit(scaled_dot_attention)
    unit = ("tf32" if case.dtype == "f32" else "f16/bf16") if tiling.mma else "f32"
    return Built(lowered.kernel, gemm_chain_flops(chain.batch, chain.m, chain.n, chain.k,
                                                  chain.h),
                 unit, inputs, reference, lambda: xla_fn(*xla_args),
                 f"tiles m{tiling.block_m} n{tiling.block_n} k{tiling.block_k} "
                 f"h{tiling.block_h}")


BUILDERS = {"attention_backward": _attention, "lm_head_backward": _lm_head,
            "gemm_chain": _chain}


# ------------------------------------------------------------------ on the device

def _as_float32(raw, dtype: str):
    import ml_dtypes
    import numpy as np
    if dtype == "bf16":
        return raw.view(ml_dtypes.bfloat16).astype(np.float32)
    return raw.view({"f32": np.float32, "f16": np.float16}[dtype]).astype(np.float32)


def max_error(got, want) -> float:
    """max |got − want| / max |want| (inf where got has NaN or inf)."""
    import numpy as np
    got, want = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def check_outputs(built: Built, got: dict) -> dict:
    """The kernel's outputs (float32 by name) against jax's: errors, tolerance, correct."""
    want = built.reference()
    errors = {name: max_error(got[name], want[name]) for name in want}
    tolerance = TOLERANCE[built.unit]
    return {"errors": errors, "tolerance": tolerance,
            "correct": all(e <= tolerance for e in errors.values())}


def time_xla_us(call: Callable) -> float:
    import jax
    for _ in range(2):
        jax.block_until_ready(call())
    times = []
    for _ in range(XLA_REPEATS):
        start = time.perf_counter()
        for _ in range(XLA_CALLS):
            result = call()
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / XLA_CALLS * 1e6)
    return statistics.median(times)


def run_case(case: Case, driver, arch: str, spec) -> dict:
    import numpy as np

    from bench.opt_levels import graph_time_us
    from stitch.codegen import kir
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble_cubin
    from stitch.cost.gemm_rates import peak_flops

    row: dict = {"name": case.name, "kind": case.kind, "dtype": case.dtype,
                 "sizes": case.sizes}
    start = time.perf_counter()
    built = BUILDERS[case.kind](case, arch)
    kernel = built.kernel
    ptx = emit_ptx(kernel, arch)
    image, reports = assemble_cubin(ptx, arch, kernel_name=kernel.name)
    report = reports[kernel.name]
    row.update(unit=built.unit, flops=built.flops, notes=built.notes, grid=kernel.grid,
               block=kernel.block, launches=kir.launches(kernel),
               registers=report.registers,
               spill_bytes=report.spill_store_bytes + report.spill_load_bytes,
               build_s=round(time.perf_counter() - start, 2))
    function = driver.load(image, kernel.name)
    pointers, outputs = [], {}
    try:
        for p in kernel.params:
            if p.is_output:
                nbytes = p.size * {"f32": 4, "bf16": 2, "f16": 2}[p.dtype]
                pointer = driver.alloc(nbytes)
                driver.fill(pointer, 0xFF, nbytes)          # NaN until written
                outputs[p.name] = (pointer, nbytes, p.dtype)
            else:
                host = np.ascontiguousarray(built.inputs[p.name]).reshape(-1)
                pointer = driver.alloc(host.nbytes)
                driver.to_device(pointer, host)
            pointers.append(pointer)

        def launch(args, stream=None) -> None:
            for _ in range(row["launches"]):
                driver.launch(function, kernel.grid, kernel.block, args, stream)
        launch(pointers)
        driver.synchronize()
        got = {}
        for name, (pointer, nbytes, dtype) in outputs.items():
            raw = np.empty(nbytes, np.uint8)
            driver.to_host(pointer, raw)
            got[name] = _as_float32(raw, dtype)
        row.update(check_outputs(built, got))
        # One timed launch sizes the graph: about TARGET_GRAPH_MS a replay.
        once = graph_time_us(driver, launch, [pointers], 1, 1)
        replays = max(1, min(50, int(TARGET_GRAPH_MS * 1e3 / max(once, 1.0))))
        row["us"] = graph_time_us(driver, launch, [pointers], replays, REPEATS)
    finally:
        for pointer in pointers:
            driver.free(pointer)
    row["xla_us"] = time_xla_us(built.xla)
    row["peak_tflops"] = (peak_flops(spec, built.unit) or spec.fp32_flops) / 1e12
    row.update(rates(built.flops, row["us"], row["peak_tflops"] * 1e12))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_kit.tensor_cores")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rehearse", action="store_true")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tensor_cores.json"
    if args.rehearse:
        path.write_text(json.dumps({"skipped": "no GPU (rehearsal)", "kernels": []}))
        return 0
    from bench.cuda_driver import Driver
    from stitch.cost.gpu_specs import get_spec
    from stitch.xla_pass.device_target import target_for_device_info

    driver = Driver()
    driver.use(0)
    facts = driver.facts()
    device = facts.name
    target = target_for_device_info(facts.name, facts.compute_capability, facts.memory_bytes)
    arch = "sm_{}{}".format(*facts.compute_capability)
    spec = get_spec(target)
    wanted = set(args.cases.split(",")) if args.cases else None
    rows = []
    for case in CASES:
        if wanted is not None and case.name not in wanted:
            continue
        try:
            row = run_case(case, driver, arch, spec)
        except Exception as exc:  # noqa: BLE001 - one case's failure is a row
            row = {"name": case.name, "kind": case.kind, "dtype": case.dtype,
                   "error": f"{type(exc).__name__}: {exc}"[:400]}
        rows.append(row)
        print(f"tensor_cores: {json.dumps(row, default=str)}", flush=True)
        path.write_text(json.dumps({"device": device, "target": target, "arch": arch,
                                    "kernels": rows}, indent=1, default=str))
    return 1 if any("error" in r or not r.get("correct", False) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
