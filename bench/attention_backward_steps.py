"""Real-size bf16 training steps through the pass (deviceless H100), for the attention
backward: the modeled whole step (XLA's module → the module the pass returns, µs) and the
values of the final entry computation that are scores-sized ([B·H, S, S] elements, any
element type: a bf16 step's S, P, dP and dS are bf16), with the attention-backward kernels
placed or the reasons they were not.

    CUDA_VISIBLE_DEVICES=-1 JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \\
        .venv-cuda/bin/python -m bench.attention_backward_steps [gpt2:12 llama:8 ...]

Run from two checkouts (PYTHONPATH) for before / after; nothing is written."""
from __future__ import annotations

import json
import sys
import time

_NO_BUFFER = frozenset({"bitcast", "get-tuple-element", "tuple", "parameter", "constant"})


def scores_sized_values(hlo_text: str, elements: int) -> int:
    """Values of the entry computation (buffers, not views) with ``elements`` elements."""
    from stitch.hlo.parser import parse_hlo
    module = parse_hlo(hlo_text)
    return sum(1 for inst in module.entry.instructions if inst.opcode not in _NO_BUFFER
               for s in (inst.shape.leaves() if inst.shape.is_tuple else [inst.shape])
               if s.is_array and s.num_elements == elements)


def measure(family: str, layers: int) -> dict:
    from bench.real_steps import config, lower_for
    from stitch.xla_pass import deviceless
    cfg = config(family, layers, "bfloat16")
    start = time.perf_counter()
    result = deviceless.compile_with_pass(lower_for(cfg, "h100"), cfg.name, "h100")
    report = result.report
    summary = report.summary()
    return {"step": cfg.name, "xla_us": summary["xla_us"],
            "delivered_us": summary["delivered_us"],
            "scores_sized_values": scores_sized_values(
                result.text, cfg.batch * cfg.heads * cfg.seq * cfg.seq),
            "backward_placed": sum("attention_backward" in n for n in report.placed),
            "backward_skipped": sorted({why for name, why in report.skipped
                                        if "attention_backward" in name}),
            "compile_s": round(time.perf_counter() - start, 1)}


def main(argv: list[str]) -> None:
    steps = [(a.split(":")[0], int(a.split(":")[1])) for a in argv] or [("gpt2", 12),
                                                                        ("llama", 8)]
    for family, layers in steps:
        print(json.dumps(measure(family, layers)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
