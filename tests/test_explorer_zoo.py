"""Every zoo model on every GPU target: the stitched plan is valid (plan() validates each
graph's kernels), never worse than XLA's own fusion decisions, and every stitched kernel
has a legal schedule."""
from __future__ import annotations

import pytest

import stitch
from stitch.explorer.planner import BYTES_SLACK
from stitch.cost.gpu_specs import get_spec
from stitch.explorer.graph_plan import validate
from tests.fixtures import DATA

TARGETS = ("v100", "a100", "h100")
MODELS = sorted(p.name for p in DATA.iterdir() if (p / "full.gpu-h100.hlo").exists())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("model", MODELS)
def test_plan_is_valid_and_never_worse_than_xla(model, target):
    p = stitch.plan((DATA / model / f"full.gpu-{target}.hlo").read_text(), target=target)
    summary = p.summary()
    assert summary["baseline_source"] == "xla"
    base, stitched = summary["baseline"], summary["stitched"]
    assert stitched["mem_kernels"] <= base["mem_kernels"]
    # Never more than the planner's slack over XLA's bytes (a launch saved for a re-read).
    assert stitched["mem_hbm_bytes"] <= base["mem_hbm_bytes"] * (1 + BYTES_SLACK)
    # GEMMs/convs are counted identically on both sides, except that a gemm_chain kernel
    # takes the place of its two GEMMs.
    chains = sum(k.kind == "gemm_chain" for k in p.kernels)
    assert (stitched["kernels"] - stitched["mem_kernels"] + chains
            == base["kernels"] - base["mem_kernels"])
    for g in p.graphs:
        validate(g.graph, g.stitched.kernels)
        validate(g.graph, g.baseline.kernels)
    # Every kernel stitch generates has a legal schedule (locality checked, launchable).
    from stitch.explorer.plan_schedules import kept_as_xla
    for g in p.graphs:
        for k in g.stitched.kernels:
            if k.kind != "fused" or not k.cost.launches:
                continue
            if kept_as_xla(g.graph, k.members):
                # XLA's fusion around an op stitch does not generate, kept whole: one of
                # XLA's kernels, never a stitched one.
                assert frozenset(k.members) in {frozenset(b.members)
                                                for b in g.baseline.kernels}, k.name
                assert "kept as is" in k.schedule_note
                continue
            assert k.schedule is not None, (k.name, k.schedule_note)
            assert k.occupancy.blocks_per_sm >= 1 and k.regs_estimate <= 255
            assert k.smem_bytes <= get_spec(target).shared_memory_per_block_optin
            assert k.grid == sum(part.blocks for part in k.schedule.parts)
            assert set(k.schemes) <= {"packing", "thread", "warp", "block", "global"}
            if "global" in k.schemes:       # a grid barrier needs every block resident
                assert k.grid <= k.schedule.parts[0].scope.resident_blocks


def test_training_graphs_meet_the_kernel_targets():
    """The bar over the zoo's training graphs (sums): memory-intensive kernels
    <= 0.45x XLA on V100 and <= 0.65x on H100."""
    training = ("bert_layer_train", "transformer_train", "dien_train", "log_softmax_xent_train")
    for target, bar in (("v100", 0.45), ("h100", 0.65)):
        base = stitched = 0
        for model in training:
            s = stitch.plan((DATA / model / f"full.gpu-{target}.hlo").read_text(),
                            target=target).summary()
            base += s["baseline"]["mem_kernels"]
            stitched += s["stitched"]["mem_kernels"]
        assert stitched <= bar * base, (target, stitched, base)
