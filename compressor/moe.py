"""NemotronH's feed-forward parts: the ReLU^2 MLP and the sigmoid-routed (latent) mixture of experts.

Names follow Hugging Face NemotronH checkpoints: `up_proj`/`down_proj` for an MLP; for a MoE `gate.weight`
and the `gate.e_score_correction_bias` buffer (the router), `experts.{j}.up_proj/down_proj`,
`shared_experts.up_proj/down_proj`, and `fc1_latent_proj`/`fc2_latent_proj` when experts work in a
latent space narrower than the hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tailor.compressor.architecture import Moe


class ReluSquaredMlp(nn.Module):
    """down(relu(up(x))^2): NemotronH's dense MLP, experts and shared expert."""

    def __init__(self, inputs: int, width: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(inputs, width, bias=False)
        self.down_proj = nn.Linear(width, inputs, bias=False)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        """The input of down_proj."""
        return F.relu(self.up_proj(x)).square()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(self.inner(x))
        return result


@dataclass(frozen=True)
class Routing:
    """Model-wide router settings of a NemotronH config."""

    scaling: float = 1.0  # routed_scaling_factor
    groups: int = 1  # n_group
    top_groups: int = 1  # topk_group
    normalise: bool = True  # norm_topk_prob


class Router(nn.Module):
    """Sigmoid scores; experts chosen on score + correction bias (within the best groups), weighted by score."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, hidden: int, experts: int, top_k: int, routing: Routing) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden) * 0.02)  # fresh: tokens spread over experts
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))
        self.top_k, self.routing = top_k, routing

    def scores(self, flat: torch.Tensor) -> torch.Tensor:
        return F.linear(flat.float(), self.weight.float()).sigmoid()

    def forward(self, flat: torch.Tensor, banned: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert indices), [tokens, top_k] each; `banned` experts are never chosen."""
        scores = self.scores(flat)
        choice = scores + self.e_score_correction_bias.float()
        routing = self.routing
        if routing.groups > 1:
            grouped = choice.view(len(flat), routing.groups, -1)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(routing.top_groups, dim=-1).indices
            keep = torch.zeros(len(flat), routing.groups, dtype=torch.bool, device=flat.device)
            keep.scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], 1), float("-inf"))
        if banned is not None:
            choice = choice.masked_fill(banned, float("-inf"))
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if routing.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * routing.scaling, chosen


class MixtureOfExperts(nn.Module):
    """Router on the hidden state; routed ReLU^2 experts (in the latent space if any); a shared expert."""

    def __init__(self, part: Moe, hidden: int, routing: Routing) -> None:
        super().__init__()
        if part.gated:
            raise ValueError("NemotronH experts are ReLU^2 MLPs; a gated MoE has no modeling here")
        inner = part.latent_size or hidden
        self.part = part
        self.gate = Router(hidden, part.num_experts, part.top_k, routing)
        self.experts = nn.ModuleList(ReluSquaredMlp(inner, part.expert_width) for _ in range(part.num_experts))
        self.shared_experts = ReluSquaredMlp(hidden, part.shared_width) if part.shared_width else None
        self.fc1_latent_proj = nn.Linear(hidden, inner, bias=False) if part.latent_size else None
        self.fc2_latent_proj = nn.Linear(inner, hidden, bias=False) if part.latent_size else None

    def to_latent(self, flat: torch.Tensor) -> torch.Tensor:
        return flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)

    def routed(self, flat: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' weighted sum for [tokens, hidden] inputs, back in the hidden space."""
        weights, chosen = self.gate(flat, banned)
        latent = self.to_latent(flat)
        out = torch.zeros(latent.shape, dtype=weights.dtype, device=latent.device)
        # Training runs every expert, those no token chose on an empty batch: each then has a gradient (zero), so
        # that FSDP's reduce-scatter is the same on every rank whatever the routing.
        for expert in range(len(self.experts)) if torch.is_grad_enabled() else chosen.unique().tolist():
            rows, rank = (chosen == expert).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[expert](latent[rows]) * weights[rows, rank, None])
        out = out.to(latent.dtype)
        return out if self.fc2_latent_proj is None else self.fc2_latent_proj(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self.routed(flat)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)
