"""The memory and time model of `tailor compress` per rank (no torch): the published case's placements, and
refusals that name the stage and the shortfall."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailor.compressor.architecture import load_architecture
from tailor.compressor.hardware import GpuCatalog
from tailor.compressor.puzzle.footprint import GIB, child_share, footprint, variants_per_slot
from tailor.compressor.puzzle.plan import Plan, Training

REPO = Path(__file__).resolve().parents[4]
SUPER = load_architecture("nemotron-3-super-120b-a12b")
PUBLISHED = Plan.load(REPO / "examples" / "plans" / "nemotron-super-b200.yaml")
CATALOG = GpuCatalog.load()
# GKD keeps the parent's layer states for every row a rank trains on; the published 4B-token budget needs
# ~330k GiB of them per rank on 8 ranks, so the placements are checked at a budget whose states fit
FITTING_GKD = PUBLISHED.model_copy(update={"gkd": Training(tokens=100_000, lr=1e-4)})


def test_the_child_is_bounded_by_the_tightest_target() -> None:
    assert child_share(SUPER, PUBLISHED) == pytest.approx(0.5)  # 2x throughput, tighter than 75.3B / 9.3B


def test_variants_per_slot_follow_the_library() -> None:
    counts = {SUPER.blocks[index].code: count for index, _, count in variants_per_slot(SUPER, PUBLISHED)}
    # Mamba: 3 head counts x 2 head dims x 2 states, and removal; MoE: 2 x 2 x 3, and removal; attention
    # with 2 KV heads: 1 KV head, and removal
    assert counts == {"M": 13, "E": 13, "*": 3}


def test_the_published_case_fits_on_one_node_of_8_b200() -> None:
    fp = footprint(SUPER, FITTING_GKD, CATALOG.get("B200-180GB"), gpus_per_node=8)
    assert fp.fits and fp.shortfalls() == [] and fp.fitting_nodes == 1
    assert [need.stage for need in fp.stages] == ["capture", "bld", "scoring", "assembly", "gkd", "evaluation"]
    gkd = next(need for need in fp.stages if need.stage == "gkd")
    assert gkd.peak_bytes == sum(gkd.parts.values()) and gkd.seconds > 0
    assert 140 * GIB < gkd.peak_bytes < fp.budget_bytes  # the child's fp32 shard and AdamW are most of it


def test_the_published_case_needs_three_nodes_of_8_h100() -> None:
    h100 = CATALOG.get("H100-80GB")
    assert footprint(SUPER, FITTING_GKD, h100, gpus_per_node=8, nodes=3).fits
    two = footprint(SUPER, FITTING_GKD, h100, gpus_per_node=8, nodes=2)
    assert not two.fits and two.fitting_nodes == 3
    (message,) = two.shortfalls()
    assert message.startswith("stage gkd needs ") and message.endswith("GiB short; try --nodes 3")


def test_one_h100_refuses_naming_the_stage_and_the_shortfall() -> None:
    fp = footprint(SUPER, FITTING_GKD, CATALOG.get("H100-80GB"))
    assert not fp.fits and fp.fitting_nodes == 23  # nodes of one H100 each
    (message,) = fp.shortfalls("spec.jobs.nodes")
    gkd = next(need for need in fp.stages if need.stage == "gkd")
    short = (gkd.peak_bytes - fp.budget_bytes) / GIB
    assert message == (f"stage gkd needs {gkd.peak_bytes / GIB:.1f} GiB per rank (most of it child shard, grads "
                       f"and AdamW (fp32)), the H100-80GB has 79.6 GiB: {short:.1f} GiB short; try spec.jobs.nodes 23")


def test_the_published_gkd_budget_fits_nowhere() -> None:
    fp = footprint(SUPER, PUBLISHED, CATALOG.get("B200-180GB"), gpus_per_node=8)
    assert fp.fitting_nodes is None
    assert fp.shortfalls()[0].endswith("no node count up to 64 fits it; try a GPU with more memory")


def test_a_stated_budget_and_the_cpu_profile() -> None:
    tight = footprint(SUPER, FITTING_GKD, CATALOG.get("B200-180GB"), gpus_per_node=8, memory_gib=100)
    assert tight.budget_bytes == 100 * GIB and not tight.fits
    assert "the budget is 100.0 GiB per rank" in tight.shortfalls()[0]
    smollm2 = Plan.load(REPO / "examples" / "plans" / "smollm2-cpu.yaml")
    fp = footprint(load_architecture("smollm2-135m"), smollm2, CATALOG.get("cpu"), gpus_per_node=2)
    assert fp.on_cpu and fp.fits and fp.budget_bytes == CATALOG.get("cpu").memory_bytes // 2  # ranks share RAM
    peak = max(need.peak_bytes for need in fp.stages if need.ranks == "all")
    assert fp.host_bytes_per_node() >= 2 * peak
