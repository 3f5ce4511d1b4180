"""Routed experts as grouped GEMMs (`Experts`) against one module per expert run in a loop (`ExpertList`, what
modelopt quantizes): the same outputs and gradients, checkpoint names either way."""

from __future__ import annotations

import pytest
import torch

from tailor.compressor.model.architecture import Moe
from tailor.compressor.model.moe import ExpertList, Experts, MixtureOfExperts, Routing, unstack_experts

EXPERTS, TOP_K, INPUTS, WIDTH, TOKENS = 8, 2, 32, 48, 64


def routing(never: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, top_k] weights and chosen experts, `never` chosen by no token."""
    scores = torch.rand(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(1))
    if never is not None:
        scores[:, never] = -1.0
    return scores.topk(TOP_K, dim=-1)


def loop_of(stacked: Experts) -> ExpertList:
    """Independent copies of the stacked experts, each training its own weights."""
    loop = ExpertList(stacked[index] for index in range(len(stacked)))
    for expert in loop:
        for linear in (expert.up_proj, expert.down_proj):
            linear.weight = torch.nn.Parameter(linear.weight.detach().clone())
    return loop


def test_grouped_experts_equal_a_loop_over_them_forward_and_backward() -> None:
    torch.manual_seed(0)
    stacked = Experts(EXPERTS, INPUTS, WIDTH)
    loop = loop_of(stacked)
    weights, chosen = routing(never=5)
    x = torch.randn(TOKENS, INPUTS, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    grouped, looped = stacked(x, weights, chosen), loop(y, weights, chosen)
    torch.testing.assert_close(grouped, looped)
    (grouped * looped.detach()).sum().backward()
    (looped * looped.detach()).sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
    assert stacked.up_proj.grad is not None and stacked.down_proj.grad is not None
    for index, expert in enumerate(loop):
        if index == 5:  # no token: a zero gradient, where the loop has none (FSDP needs one on every rank)
            assert expert.up_proj.weight.grad is None
            assert not stacked.up_proj.grad[5].any() and not stacked.down_proj.grad[5].any()
            continue
        torch.testing.assert_close(stacked.up_proj.grad[index], expert.up_proj.weight.grad)
        torch.testing.assert_close(stacked.down_proj.grad[index], expert.down_proj.weight.grad)


def test_under_bf16_autocast_the_grouped_gemms_run_in_bf16_as_the_loops_linears_do() -> None:
    torch.manual_seed(0)
    stacked = Experts(EXPERTS, INPUTS, WIDTH)
    loop = loop_of(stacked)
    weights, chosen = routing()
    x = torch.randn(TOKENS, INPUTS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grouped, looped = stacked(x, weights, chosen), loop(x, weights, chosen)
    exact = stacked(x, weights, chosen)
    assert grouped.dtype == looped.dtype == torch.float32  # summed with the routing weights
    torch.testing.assert_close(grouped, looped, rtol=1e-2, atol=1e-2)
    assert (grouped - exact).abs().max() > 0  # it did round to BF16


def test_checkpoints_name_each_expert_and_load_into_either_form() -> None:
    torch.manual_seed(0)
    part = Moe(num_experts=EXPERTS, top_k=TOP_K, expert_width=WIDTH, shared_width=16, latent_size=INPUTS)
    moe = MixtureOfExperts(part, 64, Routing())
    state = moe.state_dict()
    assert [name for name in state if name.startswith("experts.")][:4] == [
        "experts.0.up_proj.weight", "experts.0.down_proj.weight", "experts.1.up_proj.weight",
        "experts.1.down_proj.weight"]
    assert state["experts.3.down_proj.weight"].shape == (INPUTS, WIDTH)
    other = MixtureOfExperts(part, 64, Routing())
    other.load_state_dict(state)
    assert torch.equal(other.experts.up_proj, moe.experts.up_proj)
    x = torch.randn(2, 16, 64)
    unstack_experts(other)
    assert isinstance(other.experts, ExpertList) and list(other.state_dict()) == list(state)
    torch.testing.assert_close(other(x), moe(x))


def test_misaligned_expert_sizes_are_refused_naming_the_config_fields() -> None:
    with pytest.raises(ValueError, match=r"width \(44\) in multiples of 8 .*moe_intermediate_size"):
        Experts(EXPERTS, INPUTS, 44)
