"""The memory and time model of `tailor compress` per rank (no torch): the published case's placements, and
refusals that name the stage and the shortfall."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailor.compressor.compute import ComputeDtype
from tailor.compressor.model.architecture import load_architecture
from tailor.compressor.puzzle.footprint import GIB, MFU, TF32_SHARE, child_bounds, footprint, variants_per_slot
from tailor.compressor.puzzle.plan import Plan
from tailor.compressor.sizing.hardware import GpuCatalog

REPO = Path(__file__).resolve().parents[4]
SUPER = load_architecture("nemotron-3-super-120b-a12b")
PUBLISHED = Plan.load(REPO / "examples" / "plans" / "nemotron-super-b200.yaml")
RECIPE = Plan.load(REPO / "examples" / "plans" / "nemotron-super-published-recipe.yaml")
CATALOG = GpuCatalog.load()


def test_the_child_is_bounded_by_its_parameter_targets_not_by_throughput() -> None:
    assert child_bounds(SUPER, PUBLISHED) == pytest.approx((75.3e9, 9.3e9))  # the plan's paramsBillions caps
    speed_only = PUBLISHED.model_copy(update={"target": PUBLISHED.target.model_copy(update={
        "params_billions": None, "active_params_billions": None})})
    assert child_bounds(SUPER, speed_only) == (SUPER.total_params, SUPER.active_param_count)  # 2x bounds no size


def test_gkd_time_counts_active_parameters_at_the_peak_each_pass_runs_at() -> None:
    """By hand: 6 x 9.3B (the child trains) + 2 x 12.77B (the parent's forward) FLOPs per token, at 35% of the
    B200's 2,250 BF16 TFLOPS; computing in float32 on a GPU, both run at TF32's half of it."""
    b200 = CATALOG.get("B200-180GB")
    tokens = PUBLISHED.gkd.tokens
    gkd = next(need for need in footprint(SUPER, PUBLISHED, b200, gpus_per_node=8).stages if need.stage == "gkd")
    rate = 8 * 2250e12 * MFU
    assert gkd.seconds == pytest.approx((6 * 9.3e9 + 2 * SUPER.active_param_count) * tokens / rate, rel=1e-3)
    fp32 = PUBLISHED.model_copy(update={"compute_dtype": ComputeDtype.FLOAT32})
    slow = next(need for need in footprint(SUPER, fp32, b200, gpus_per_node=8).stages if need.stage == "gkd")
    assert slow.seconds == pytest.approx(gkd.seconds / TF32_SHARE, rel=1e-3)


def test_gkd_holds_a_ranks_share_of_the_batch() -> None:
    """gkd.batch 16 over 8 ranks: 2 rows each, over 16 ranks: 1; the KL's 5.3 float32 [rows, seq, vocab] tensors
    (bench/gkd_memory.py) by hand."""
    plan = PUBLISHED.model_copy(update={"gkd": PUBLISHED.gkd.model_copy(update={"batch": 16})})
    b200 = CATALOG.get("B200-180GB")

    def gkd(nodes: int) -> dict[str, int]:
        fp = footprint(SUPER, plan, b200, gpus_per_node=8, nodes=nodes)
        return next(need.parts for need in fp.stages if need.stage == "gkd")

    one, two = gkd(1), gkd(2)
    assert one["logits and the KL's temporaries"] == round(5.3 * 2 * 128 * 131072 * 4)
    assert two["logits and the KL's temporaries"] == round(5.3 * 1 * 128 * 131072 * 4)
    assert one["activations for backward"] == 2 * two["activations for backward"]


def test_the_claim_holds_one_rounds_streams_in_the_frozen_dtype() -> None:
    """88 slots x (8,192 BLD + 1,024 scoring tokens) x 4,096 x 2 bytes (BF16 on a GPU), by hand; float32 on a CPU."""
    b200 = CATALOG.get("B200-180GB")
    claim = footprint(SUPER, PUBLISHED, b200, gpus_per_node=8).stage_files
    assert claim["captured streams (one round)"] == 88 * (8192 + 1024) * 4096 * 2
    assert claim["token windows (int32)"] == 4 * (PUBLISHED.gkd.tokens + 1024 + 4096 + 128)
    cpu = footprint(SUPER, PUBLISHED, CATALOG.get("cpu")).stage_files
    assert cpu["captured streams (one round)"] == 2 * claim["captured streams (one round)"]


def test_variants_per_slot_follow_the_library() -> None:
    counts = {SUPER.blocks[index].code: count for index, _, count in variants_per_slot(SUPER, PUBLISHED)}
    # for vLLM (the plan's engine), which reads one Mamba shape and builds every block of a hybrid: Mamba 2 states
    # (heads and head dim stay), MoE 2 expert counts x 3 top-k x 4 widths, no removal; attention is kept whole in a
    # hybrid parent (the published child kept it)
    assert counts == {"M": 2, "E": 24, "*": 1}


def test_the_published_case_fits_on_two_nodes_of_8_b200() -> None:
    b200 = CATALOG.get("B200-180GB")
    fp = footprint(SUPER, PUBLISHED, b200, gpus_per_node=8, nodes=2)
    assert fp.fits and fp.shortfalls() == [] and fp.fitting_nodes == 2
    assert [need.stage for need in fp.stages] == ["capture", "bld", "scoring", "assembly", "gkd", "evaluation"]
    gkd = next(need for need in fp.stages if need.stage == "gkd")
    assert gkd.peak_bytes == sum(gkd.parts.values()) and gkd.seconds > 0
    assert "teacher shard" in gkd.parts  # the parent sharded beside the child, not streamed
    (message,) = footprint(SUPER, PUBLISHED, b200, gpus_per_node=8).shortfalls()
    assert message.startswith("stage gkd needs ") and message.endswith("GiB short; try --nodes 2")


def test_the_published_case_needs_five_nodes_of_8_h100() -> None:
    h100 = CATALOG.get("H100-80GB")
    assert footprint(SUPER, PUBLISHED, h100, gpus_per_node=8, nodes=5).fits
    four = footprint(SUPER, PUBLISHED, h100, gpus_per_node=8, nodes=4)
    assert not four.fits and four.fitting_nodes == 5
    (message,) = four.shortfalls()
    assert message.startswith("stage gkd needs ") and message.endswith("GiB short; try --nodes 5")


def test_one_h100_refuses_naming_the_stage_and_the_shortfall() -> None:
    fp = footprint(SUPER, PUBLISHED, CATALOG.get("H100-80GB"))
    assert not fp.fits
    (message,) = fp.shortfalls("spec.jobs.nodes")
    gkd = next(need for need in fp.stages if need.stage == "gkd")
    short = (gkd.peak_bytes - fp.budget_bytes) / GIB
    assert message.startswith(f"stage gkd needs {gkd.peak_bytes / GIB:.1f} GiB per rank (most of it ")
    assert f"the H100-80GB has 79.6 GiB: {short:.1f} GiB short; try spec.jobs.nodes {fp.fitting_nodes}" in message


def test_a_teacher_too_large_to_shard_is_streamed_within_the_budget() -> None:
    """A parent several times the budget: its states are kept for a quarter of the budget's worth of steps."""
    fp = footprint(SUPER, PUBLISHED, CATALOG.get("B200-180GB"), gpus_per_node=8, nodes=1)
    gkd = next(need for need in fp.stages if need.stage == "gkd")
    assert "teacher shard" not in gkd.parts
    assert gkd.parts["teacher layer states (bf16)"] == fp.budget_bytes // 4


def test_a_stated_budget_and_the_cpu_profile() -> None:
    tight = footprint(SUPER, PUBLISHED, CATALOG.get("B200-180GB"), gpus_per_node=8, memory_gib=100)
    assert tight.budget_bytes == 100 * GIB and not tight.fits
    assert "the budget is 100.0 GiB per rank" in tight.shortfalls()[0]
    smollm2 = Plan.load(REPO / "examples" / "plans" / "smollm2-cpu.yaml")
    fp = footprint(load_architecture("smollm2-135m"), smollm2, CATALOG.get("cpu"), gpus_per_node=2)
    assert fp.on_cpu and fp.fits and fp.budget_bytes == CATALOG.get("cpu").memory_bytes // 2  # ranks share RAM
    peak = max(need.peak_bytes for need in fp.stages if need.ranks == "all")
    assert fp.host_bytes_per_node() >= 2 * peak


def test_the_default_library_can_make_the_published_child() -> None:
    """The published child: all 8 attention layers kept, routed experts cut unevenly to a mean of ~60% of 2688,
    top-k 22 -> a mean of ~10 (11 and 8 offered), the SSM state 128 -> 96 everywhere. Each is among the defaults'
    options."""
    from tailor.compressor.model.architecture import Mamba, Moe
    from tailor.compressor.puzzle.options import part_options

    mamba = next(p for b in SUPER.blocks for p in b.parts() if isinstance(p, Mamba))
    moe = next(p for b in SUPER.blocks for p in b.parts() if isinstance(p, Moe))
    library = PUBLISHED.library
    assert {p.state_size for p in part_options(mamba, mamba, 1, library, hybrid=True) if isinstance(p, Mamba)} == {
        128, 96}
    options = [p for p in part_options(moe, moe, 1, library, hybrid=True) if isinstance(p, Moe)]
    widths = sorted({p.expert_width for p in options})
    assert widths == [1280, 1664, 2048, 2688] and all(w % 128 == 0 for w in widths)  # 0.5, 0.6, 0.75, 1 of 2688
    assert {p.top_k for p in options} == {22, 11, 8}  # a mean of ~10 mixes 11 and 8 over the layers
    with_counts = library.model_copy(update={"top_k_values": [10, 9]})
    assert {p.top_k for p in part_options(moe, moe, 1, with_counts, hybrid=True) if isinstance(p, Moe)} == {
        22, 11, 10, 9, 8}
    attention = next(p for b in SUPER.blocks for p in b.parts() if p.kind == "attention")
    assert part_options(attention, attention, 5, library, hybrid=True) == [attention]
    shrinkable = library.model_copy(update={"keep_attention": False})
    assert len(part_options(attention, attention, 5, shrinkable, hybrid=True)) > 1


def test_bld_holds_one_slot_and_its_most_demanding_trained_variant() -> None:
    b200 = CATALOG.get("B200-180GB")
    bld = next(need for need in footprint(SUPER, PUBLISHED, b200, gpus_per_node=8, nodes=2).stages
               if need.stage == "bld")
    assert set(bld.parts) == {"the slot's layer", "a variant at its peak", "a chunk of inputs and targets",
                              "BF16 kernels (CPU)", "runtime"}
    assert bld.parts["BF16 kernels (CPU)"] == 0  # a CPU-only term
    # a Mamba-2 scan keeps per-chunk states that grow with the chunk: longer rows, a larger step
    data = PUBLISHED.data.model_copy(update={"seq_len": 4 * PUBLISHED.data.seq_len})
    longer = PUBLISHED.model_copy(update={"data": data})
    longer_bld = next(need for need in footprint(SUPER, longer, b200, gpus_per_node=8, nodes=2).stages
                      if need.stage == "bld")
    assert longer_bld.parts["a variant at its peak"] > bld.parts["a variant at its peak"]


def test_the_model_follows_the_code_it_describes() -> None:
    from tailor.compressor.model import mamba
    from tailor.compressor.puzzle import bld
    from tailor.compressor.puzzle import footprint as model

    assert (model.MAMBA_CHUNK, model.EVAL_ROWS) == (mamba.CHUNK, bld.EVAL_ROWS)


def test_the_published_recipe_fits_two_nodes_of_8_b200_with_one_recomputed_row_at_a_time() -> None:
    """At 4,096-token windows a rank runs one row, keeping one block's activations: the largest is a Mamba-2
    block's (by hand from reference/nemotron3.md, d_inner 8192, 128 heads, state 128, conv_dim 8192 + 2 x 8 x 128:
    36 x 8192 + 8 x 128 x (128 + 256) + 4 x 10240 + 8 x 4096 bytes per token, `training_bytes_per_token`'s
    measured coefficients); the child's 16 bytes per parameter are what one node cannot hold without
    `gkd.offload`."""
    b200 = CATALOG.get("B200-180GB")
    two = footprint(SUPER, RECIPE, b200, gpus_per_node=8, nodes=2)
    assert two.fits
    gkd = next(need.parts for need in two.stages if need.stage == "gkd")
    assert gkd["activations for backward"] == 4096 * (36 * 8192 + 8 * 128 * (128 + 256) + 4 * 10240 + 8 * 4096)
    assert gkd["logits and the KL's temporaries"] == round(5.3 * 4096 * 131072 * 4)
    every_layer = RECIPE.model_copy(update={"gkd": RECIPE.gkd.model_copy(update={"recompute": False})})
    kept = next(need.parts for need in footprint(SUPER, every_layer, b200, gpus_per_node=8, nodes=2).stages
                if need.stage == "gkd")
    assert kept["activations for backward"] > 40 * gkd["activations for backward"]  # 88 blocks' worth
    (message,) = footprint(SUPER, RECIPE, b200, gpus_per_node=8).shortfalls()
    assert "most of it child shard, grads and AdamW (fp32)" in message and message.endswith("try --nodes 2")


def offloaded(micro_batch: int) -> Plan:
    return RECIPE.with_settings(["gkd.offload=true", f"gkd.microBatch={micro_batch}"])


def test_with_the_childs_state_offloaded_the_published_recipe_fits_one_node_of_8_b200() -> None:
    """The child's float32 shard, gradients and AdamW moments move to host memory: 16 x 75.3B bytes per node
    (1,122 GiB of the p6-b200.48xlarge's 2,048), none on the GPUs; eight rows a step then fit at once."""
    b200 = CATALOG.get("B200-180GB")
    one = footprint(SUPER, offloaded(8), b200, gpus_per_node=8)
    assert one.fits and one.fitting_nodes == 1
    gkd = next(need for need in one.stages if need.stage == "gkd")
    assert not any(name.startswith("child shard") for name in gkd.parts)
    assert gkd.host_parts == {"child shard, grads and AdamW (fp32, offloaded)": round(16 * 75.3e9 / 8)}
    assert one.offloaded_bytes_per_node == pytest.approx(16 * 75.3e9, rel=1e-6)
    assert not footprint(SUPER, RECIPE, b200, gpus_per_node=8).fits  # the same recipe without it


def test_offloading_costs_its_copies_and_a_host_adamw_step_by_hand() -> None:
    """Per step (45B tokens / (64 rows x 4,096) = 171,662 steps), each of a rank's micro-batches copies its
    9.41B-parameter float32 shard in twice and its gradient out once at 50 GB/s, and the node's AdamW streams 28
    bytes per child parameter at 400 GB/s."""
    b200 = CATALOG.get("B200-180GB")
    steps = -(-45_000_000_000 // (64 * 4096))
    shard = 75.3e9 / 8
    for micro_batch in (1, 8):
        plain = next(need for need in footprint(SUPER, RECIPE, b200, gpus_per_node=8).stages if need.stage == "gkd")
        moved = next(need for need in footprint(SUPER, offloaded(micro_batch), b200, gpus_per_node=8).stages
                     if need.stage == "gkd")
        copies = steps * (8 // micro_batch) * 3 * 4 * shard / 50e9
        adamw = steps * 28 * 75.3e9 / 400e9
        assert moved.seconds - plain.seconds == pytest.approx(copies + adamw, rel=1e-6)


def test_a_node_without_the_host_memory_for_the_offloaded_child_is_refused_by_name() -> None:
    """1,122 GiB of offloaded state does not fit a node of 512 GiB: three nodes hold a third each."""
    small = CATALOG.get("B200-180GB").model_copy(update={"host_memory_gib": 512})
    fp = footprint(SUPER, offloaded(8), small, gpus_per_node=8)
    assert not fp.fits and not fp.host_fits and fp.fitting_nodes == 3
    (message,) = fp.shortfalls()
    assert message == ("GKD's offloaded child state needs 1,122 GiB of host memory per node, a B200-180GB node has "
                       "512 GiB (its profile's hostMemoryGiB); try --nodes 3")
