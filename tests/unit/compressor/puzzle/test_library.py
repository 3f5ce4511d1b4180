"""Block library initialisation: exact where it should be, better than naive where it claims to be."""

from __future__ import annotations

import torch

from tailor.compressor.model.architecture import Attention, Linear, Mlp
from tailor.compressor.model.modeling import GatedMlp, ModelSettings, RMSNorm, SelfAttention, Slot, residual
from tailor.compressor.puzzle.bld import normalised_mse
from tailor.compressor.puzzle.library import Variant, init_variant, slot_variants
from tailor.compressor.puzzle.plan import Library
from tailor.compressor.sizing.engines import Engine

SETTINGS = ModelSettings()
ROWS = 1  # calibration sequences read at a time: every statistic is summed over several chunks
HIDDEN = 32
ATTENTION = Attention(num_heads=4, num_kv_heads=2, head_dim=8)


@torch.no_grad()
def branch_output(branch: tuple[torch.nn.Module, torch.nn.Module] | None, x: torch.Tensor) -> torch.Tensor:
    return residual(branch, x) - x


def test_the_library_offers_smaller_options_only() -> None:
    attention = slot_variants(Slot(0, 0, "mixer", ATTENTION), ATTENTION, Library(linear=True), Engine.PYTHON)
    assert [v.label for v in attention] == ["kv2", "kv1", "linear", "noop"]
    ffn = Mlp(intermediate_size=256, gated=True)
    narrowed = Mlp(intermediate_size=128, gated=True)
    labels = [v.label for v in slot_variants(Slot(1, 0, "ffn", narrowed), ffn,
                                             Library(ffn_widths=[0.75, 0.5, 0.25], linear=True), Engine.PYTHON)]
    assert labels == ["w128", "w64", "linear", "noop"]  # 0.75 and 0.5 of the parent are not smaller than 128
    bare = slot_variants(Slot(1, 0, "ffn", ffn), ffn, Library(linear=False, no_op=False))
    assert [v.label for v in bare] == ["w256", "w192", "w128", "w64"]


def test_a_child_for_vllm_gets_only_blocks_vllm_loads() -> None:
    """No linear maps, and the first block keeps its attention (vLLM's DeciLM forward fails without it)."""
    first = slot_variants(Slot(0, 0, "mixer", ATTENTION), ATTENTION, Library(), Engine.VLLM)
    later = slot_variants(Slot(2, 1, "mixer", ATTENTION), ATTENTION, Library(), Engine.VLLM)
    ffn = Mlp(intermediate_size=256, gated=True)
    first_ffn = slot_variants(Slot(1, 0, "ffn", ffn), ffn, Library(ffn_widths=[0.5]), Engine.VLLM)
    assert [v.label for v in first] == ["kv2", "kv1"] and [v.label for v in later] == ["kv2", "kv1", "noop"]
    assert [v.label for v in first_ffn] == ["w256", "w128", "noop"]


def test_pooling_identical_kv_heads_changes_nothing() -> None:
    torch.manual_seed(0)
    attention = SelfAttention(ATTENTION, HIDDEN, SETTINGS.rope_theta)
    with torch.no_grad():  # make both KV heads of the parent equal: pooling them to one is then exact
        for proj in (attention.k_proj, attention.v_proj):
            proj.weight[8:] = proj.weight[:8]
    current = (RMSNorm(HIDDEN, 1e-5), attention)
    x = torch.randn(2, 10, HIDDEN)
    variant = Variant(slot=0, kind="mixer", part=ATTENTION.model_copy(update={"num_kv_heads": 1}))
    pooled = init_variant(variant, current, x, SETTINGS, ROWS)
    torch.testing.assert_close(branch_output(pooled, x), branch_output(current, x), atol=1e-5, rtol=1e-5)


def test_channel_contribution_beats_a_random_choice_of_channels() -> None:
    torch.manual_seed(0)
    mlp = GatedMlp(HIDDEN, 128)
    with torch.no_grad():
        mlp.down_proj.weight[:, :32] *= 20  # a quarter of the channels carry most of the output
    current = (RMSNorm(HIDDEN, 1e-5), mlp)
    x = torch.randn(4, 16, HIDDEN)
    target = branch_output(current, x)
    narrowed = Variant(slot=1, kind="ffn", part=Mlp(intermediate_size=32, gated=True))
    pruned = init_variant(narrowed, current, x, SETTINGS, ROWS)
    random_keep = torch.randperm(128)[:32]
    naive = GatedMlp(HIDDEN, 32)
    with torch.no_grad():
        naive.gate_proj.weight.copy_(mlp.gate_proj.weight[random_keep])
        naive.up_proj.weight.copy_(mlp.up_proj.weight[random_keep])
        naive.down_proj.weight.copy_(mlp.down_proj.weight[:, random_keep])
    ours = float(normalised_mse(branch_output(pruned, x), target))
    theirs = float(normalised_mse(branch_output((current[0], naive), x), target))
    assert ours < 0.2 < theirs


def test_a_linear_replacement_starts_no_worse_than_removal() -> None:
    torch.manual_seed(0)
    current = (RMSNorm(HIDDEN, 1e-5), GatedMlp(HIDDEN, 64))
    x = torch.randn(8, 16, HIDDEN)
    fitted = init_variant(Variant(slot=1, kind="ffn", part=Linear()), current, x, SETTINGS, ROWS)
    target = branch_output(current, x)
    assert float(normalised_mse(branch_output(fitted, x), target)) < 1.0  # removal scores exactly 1
