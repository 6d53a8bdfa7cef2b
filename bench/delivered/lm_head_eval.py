"""The LM head + cross-entropy eval loss at GPT-2 small's size (8 x 1024 tokens, vocabulary
50257, 768 wide, tied embedding), f32 and bf16, compiled deviceless for an H100 stock and
with the pass, one child each (``children.run_one``): whether the site is placed, XLA's
kernels before and after, ``compiled.memory_analysis()`` temp and peak bytes of both final
modules (counted), and the fused kernel's modeled time at the schedule the pass builds
(spilling ones struck) against XLA's GEMM plus one read of the logits
(``cost.lm_head_pricing``).

``python -m bench delivered --part lm-head-eval`` (about a minute; the CUDA venv of
scripts/deviceless_check.sh).
"""
from __future__ import annotations

import argparse
import json

from bench.delivered.children import run_one

MARK = "LM_HEAD_EVAL_ROW "
BATCH, SEQ, HIDDEN, VOCAB = 8, 1024, 768, 50257
CASES = ("f32", "bf16")


def loss(h, emb, labels):
    """As bench/real_steps.py writes the LM head's loss (tied embedding), eval only."""
    import jax
    import jax.numpy as jnp
    logits = jnp.einsum("bsd,vd->bsv", h, emb).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def one(dtype: str) -> dict:
    """Compile the case (in the CUDA venv, GPUs hidden) and return its row."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from stitch.cost import get_spec
    from stitch.pricing.lm_head_pricing import loss_price
    from stitch.hlo.lm_head_loss import LmHeadLoss, row_major_views
    from stitch.xla_pass import deviceless
    from stitch.xla_pass.lm_head_placement import spill_check

    deviceless.ensure_pass_registered()
    mesh = topologies.make_mesh(deviceless.topology("h100", "1x1x1"), (1,), ("d",))
    replicated = NamedSharding(mesh, P())
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    args = (jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), dt, sharding=replicated),
            jax.ShapeDtypeStruct((VOCAB, HIDDEN), dt, sharding=replicated),
            jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=replicated))
    lowered = jax.jit(loss).lower(*args)
    stock = lowered.compile().memory_analysis()
    result = deviceless.compile_with_pass(lowered, f"lm_head_eval_{dtype}", "h100")
    stitched = result.compiled.memory_analysis()
    report = result.report
    hv, ev = row_major_views(0, 1, BATCH * SEQ, VOCAB, HIDDEN)
    site = LmHeadLoss(BATCH * SEQ, VOCAB, HIDDEN, hv, ev, 2, dtype, dtype, tf32=True,
                      log_prob_sum=3)
    # Priced as the pass prices it: ptxas strikes the schedules that spill.
    price = loss_price(get_spec("h100"), site, grid_sync=True,
                       spills=spill_check(site, "sm_90"))
    return {"case": dtype,
            "placed": any(n.startswith("lm_head_loss") for n in report.placed),
            "kernels_before": report.kernels_xla, "kernels_after": report.kernels_after,
            "temp_stock": stock.temp_size_in_bytes, "temp_stitched": stitched.temp_size_in_bytes,
            "peak_stock": stock.peak_memory_in_bytes,
            "peak_stitched": stitched.peak_memory_in_bytes,
            "stitch_ms": price.stitched.seconds * 1e3, "xla_ms": price.xla_s * 1e3,
            "schedule": price.schedule.text()}


def collect(cases=CASES) -> list[dict]:
    return [run_one("bench.delivered.lm_head_eval", c, MARK, "case", 900) for c in cases]


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        f"GPT-2 small's LM head eval loss ({BATCH} x {SEQ} tokens, vocabulary {VOCAB}, "
        f"{HIDDEN} wide) compiled deviceless for an H100, stock and with the pass: XLA's "
        "kernels, temp and peak bytes of the final modules (`compiled.memory_analysis()`, "
        "counted); the fused kernel's time modeled (GEMM-tile model) against XLA's GEMM plus "
        "one read of the logits (a lower bound). Regenerate: `" + command + "`.",
        "",
        "| type | placed | kernels | temp MB | peak MB | stitch ms (schedule) | XLA ≥ ms |",
        "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {'yes' if r['placed'] else 'no'} | "
            f"{r['kernels_before']} → {r['kernels_after']} | "
            f"{r['temp_stock'] / 1e6:,.1f} → {r['temp_stitched'] / 1e6:,.1f} | "
            f"{r['peak_stock'] / 1e6:,.1f} → {r['peak_stitched'] / 1e6:,.1f} | "
            f"{r['stitch_ms']:.2f} ({r['schedule']}) | {r['xla_ms']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help="compile one case here (the CUDA venv's child)")
    args = parser.parse_args()
    if args.one:
        print(MARK + json.dumps(one(args.one)), flush=True)
        return
    print(markdown(collect(), "python -m bench.delivered.lm_head_eval"))


if __name__ == "__main__":
    main()
