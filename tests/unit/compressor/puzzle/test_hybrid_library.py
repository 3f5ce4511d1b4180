"""The hybrid block library: Mamba-2 and MoE variants, and which heads, states and experts they keep."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tailor.compressor.model.architecture import Linear, Mamba, Mlp, Moe, NoOp, Part
from tailor.compressor.model.mamba import Mamba2
from tailor.compressor.model.modeling import ModelSettings, Slot, build_branch, residual
from tailor.compressor.model.moe import MixtureOfExperts, Routing
from tailor.compressor.puzzle.library import Variant, init_variant, prune_mamba, prune_moe, slot_variants
from tailor.compressor.puzzle.plan import Library
from tailor.compressor.sizing.engines import Engine

HIDDEN = 32
MAMBA = Mamba(num_heads=8, head_dim=8, state_size=16, n_groups=2, conv_kernel=4)
MOE = Moe(num_experts=8, top_k=2, expert_width=32, shared_width=48, latent_size=16)
SETTINGS = ModelSettings(family="nemotron_h", rope_theta=None)
ROWS = 1  # calibration sequences read at a time: every statistic is summed over several chunks


def mamba(part: Mamba = MAMBA, seed: int = 0) -> Mamba2:
    torch.manual_seed(seed)
    module = Mamba2(part, HIDDEN, 1e-5, 0.001)
    with torch.no_grad():
        for weight in module.parameters():
            if weight.dim() > 1:
                weight.normal_(0.0, 0.3)
    return module


def moe(part: Moe = MOE, seed: int = 0) -> MixtureOfExperts:
    torch.manual_seed(seed)
    module = MixtureOfExperts(part, HIDDEN, Routing())
    with torch.no_grad():
        for weight in module.parameters():
            weight.normal_(0.0, 0.3)
    return module


def inputs(tokens: int = 64) -> torch.Tensor:
    return torch.randn(4, tokens, HIDDEN, generator=torch.Generator().manual_seed(5))


def test_mamba_variants_combine_heads_head_dims_and_states_below_the_current_block() -> None:
    library = Library(mamba_heads=[0.5], mamba_head_dims=[0.5], ssm_states=[0.75], linear=True)
    variants = slot_variants(Slot(0, 0, "mixer", MAMBA), MAMBA, library, Engine.PYTHON)
    assert variants[0].is_current and variants[0].label == "h8d8s16"
    assert [v.label for v in variants[1:]] == ["h8d8s12", "h8d4s16", "h8d4s12", "h4d8s16", "h4d8s12", "h4d4s16",
                                               "h4d4s12", "linear", "noop"]
    assert {v.state for v in variants} == {16, 12, None}
    pruned = MAMBA.model_copy(update={"num_heads": 4, "state_size": 12})  # a later round's current block
    later = slot_variants(Slot(0, 0, "mixer", pruned), MAMBA, library)
    assert all(v.part.num_heads <= 4 and v.part.state_size <= 12 for v in later if isinstance(v.part, Mamba))
    assert later[0].part == pruned and len({v.label for v in later}) == len(later)


def test_moe_variants_cover_experts_top_k_and_widths() -> None:
    library = Library(experts_kept=[0.5], top_k=[0.5], expert_widths=[0.5], shared_widths=[0.5], linear=False,
                      no_op=False)
    labels = [v.label for v in slot_variants(Slot(1, 1, "ffn", MOE), MOE, library)]
    assert labels[0] == "e8k2w32s48" and len(labels) == 16 == len(set(labels))
    assert "e4k1w16s32" in labels  # 48 * 0.5 = 24 rounds to a multiple of 16 channels: 32


def test_pruning_a_mamba_block_to_its_own_size_changes_nothing() -> None:
    old, new = mamba(), Mamba2(MAMBA, HIDDEN, 1e-5, 0.001)
    x = inputs()
    with torch.no_grad():
        prune_mamba(old, new, torch.split(x, ROWS))
        torch.testing.assert_close(new(x), old(x))


def test_mamba_pruning_drops_silent_heads_and_unused_state_channels() -> None:
    old, x = mamba(), inputs()
    part = old.part
    with torch.no_grad():
        for head in (2, 5):  # one head in each group writes nothing to the output
            old.out_proj.weight[:, head * part.head_dim:(head + 1) * part.head_dim] = 0
        b_channel = part.inner + part.inner + 3  # state channel 3 of group 0: B is always 0
        old.in_proj.weight[b_channel] = 0
        old.conv1d.weight[part.inner + 3] = 0
        old.conv1d.bias[part.inner + 3] = 0
        new = Mamba2(part.model_copy(update={"num_heads": 6, "state_size": 15}), HIDDEN, 1e-5, 0.001)
        prune_mamba(old, new, torch.split(x, ROWS))
    torch.testing.assert_close(new.A_log, old.A_log[[0, 1, 3, 4, 6, 7]])
    kept_b = new.conv1d.weight[new.part.inner:new.part.inner + 15, 0]  # group 0's B channels, in order
    expected = torch.cat([old.conv1d.weight[part.inner + n, 0][None] for n in range(16) if n != 3])
    torch.testing.assert_close(kept_b, expected)
    assert new(x).shape == x.shape


def test_moe_pruning_removes_the_expert_whose_removal_changes_nothing() -> None:
    old, x = moe(), inputs()
    with torch.no_grad():
        old.gate.e_score_correction_bias.normal_(0.0, 0.1)
        old.gate.e_score_correction_bias[3] = -10.0  # never chosen: removing it changes nothing
        new = MixtureOfExperts(MOE.model_copy(update={"num_experts": 7, "expert_width": 24}), HIDDEN, Routing())
        prune_moe(old, new, torch.split(x, ROWS))
    kept = [0, 1, 2, 4, 5, 6, 7]
    torch.testing.assert_close(new.gate.weight, old.gate.weight[kept])
    torch.testing.assert_close(new.gate.e_score_correction_bias, old.gate.e_score_correction_bias[kept])
    assert new.fc1_latent_proj is not None and old.fc1_latent_proj is not None
    torch.testing.assert_close(new.fc1_latent_proj.weight, old.fc1_latent_proj.weight)
    assert new(x).shape == x.shape


@pytest.mark.parametrize("update", [{"top_k": 1}, {"shared_width": 16}, {"expert_width": 16}])
def test_initialised_moe_variants_stay_close_to_their_block(update: dict[str, Any]) -> None:
    old_branch = build_branch("ffn", MOE, HIDDEN, SETTINGS)
    assert old_branch is not None
    with torch.no_grad():
        old_branch[1].load_state_dict(moe().state_dict())
    x = inputs()
    variant = Variant(slot=0, kind="ffn", part=MOE.model_copy(update=update))
    branch = init_variant(variant, old_branch, x, SETTINGS, ROWS)
    assert branch is not None
    with torch.no_grad():
        target = residual(old_branch, x) - x
        error = (residual(branch, x) - x - target).pow(2).mean() / target.pow(2).mean()
        removed = Variant(slot=0, kind="ffn", part=NoOp())
        assert init_variant(removed, old_branch, x, SETTINGS, ROWS) is None
        linear = init_variant(Variant(slot=0, kind="ffn", part=Linear()), old_branch, x, SETTINGS, ROWS)
        linear_error = (residual(linear, x) - x - target).pow(2).mean() / target.pow(2).mean()
    assert 0 < error < 1 and 0 < linear_error < 1


def test_in_training_every_expert_gets_a_gradient_whatever_the_routing() -> None:
    """FSDP reduce-scatters the same gradients on every rank: an expert no token chose on one rank must still
    have one (zero), or two ranks' collectives differ in size (a gloo crash in GKD on NemotronH parents)."""
    module = moe()
    with torch.no_grad():
        module.gate.e_score_correction_bias[3] = -10.0  # never chosen
    x = inputs(8)
    module(x).sum().backward()
    chosen = int(module.gate(x.reshape(-1, HIDDEN))[1][0, 0])
    for stacked in (module.experts.up_proj, module.experts.down_proj):
        assert stacked.grad is not None and not stacked.grad[3].any() and stacked.grad[chosen].any()


@pytest.mark.parametrize("kind,parent,variant", [
    ("mixer", MAMBA, MAMBA.model_copy(update={"num_heads": 4, "state_size": 8})),
    ("ffn", MOE, MOE.model_copy(update={"num_experts": 6, "top_k": 1, "expert_width": 16, "shared_width": 16})),
    ("ffn", Mlp(intermediate_size=64, gated=False), Mlp(intermediate_size=32, gated=False)),
    ("ffn", MOE, Linear()),
])
def test_a_variant_initialised_a_sequence_at_a_time_equals_one_initialised_on_every_row(
        kind: str, parent: Part, variant: Part) -> None:
    """BLD reads the calibration rows a few sequences at a time (bounded memory); the statistics it sums must
    pick the same channels, heads and experts, and fit the same linear map, as on all rows at once."""
    torch.manual_seed(3)
    old_branch = build_branch(kind, parent, HIDDEN, SETTINGS)
    assert old_branch is not None
    x = inputs()
    choice = Variant(slot=0, kind=kind, part=variant)
    whole, chunked = (init_variant(choice, old_branch, x, SETTINGS, rows) for rows in (x.shape[0], 1))
    assert whole is not None and chunked is not None
    for (name, expected), (_, actual) in zip(whole[1].state_dict().items(), chunked[1].state_dict().items(),
                                             strict=True):
        torch.testing.assert_close(actual, expected, msg=name)
