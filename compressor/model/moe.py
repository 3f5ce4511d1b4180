"""NemotronH's feed-forward parts: the ReLU^2 MLP and the sigmoid-routed (latent) mixture of experts.

Names follow Hugging Face NemotronH checkpoints: `up_proj`/`down_proj` for an MLP; for a MoE `gate.weight`
and the `gate.e_score_correction_bias` buffer (the router), `experts.{j}.up_proj/down_proj`,
`shared_experts.up_proj/down_proj`, and `fc1_latent_proj`/`fc2_latent_proj` when experts work in a
latent space narrower than the hidden state.

Routed experts train and run as two grouped GEMMs over their weights stacked (`Experts`); modelopt quantizes
and a quantized checkpoint restores one `nn.Linear` per expert (`ExpertList`, made by `unstack_experts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tailor.compressor.model.architecture import Moe

PROJECTIONS = ("up_proj", "down_proj")
ALIGNMENT = 8  # grouped GEMMs read rows of 16 bytes and more: 8 BF16 values


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


class ExpertList(nn.ModuleList):
    """Routed experts as one `ReluSquaredMlp` each, run one after another on the tokens routed to it: the form
    modelopt calibrates and exports (one `nn.Linear` per expert) and a quantized checkpoint restores to. No
    training runs here (an expert no token chose would get no gradient)."""

    def forward(self, latent: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(latent.shape, dtype=weights.dtype, device=latent.device)
        for expert in torch.unique(chosen).tolist():
            rows, rank = (chosen == expert).nonzero(as_tuple=True)
            out.index_add_(0, rows, self[expert](latent[rows]) * weights[rows, rank, None])
        return out


class Experts(nn.Module):
    """Routed ReLU^2 experts with their weights stacked, `up_proj` [experts, width, inputs] and `down_proj`
    [experts, inputs, width] (each expert in `nn.Linear`'s layout), run as two grouped GEMMs over the tokens'
    copies sorted by expert: `F.grouped_mm`, CUTLASS kernels for BF16 on Hopper and Blackwell, one matmul per
    expert inside torch elsewhere. Every expert gets a gradient, zero when no token chose it, so FSDP
    reduce-scatters the same tensors on every rank whatever the routing.

    State dicts name each expert as checkpoints do (`{j}.up_proj.weight`); sharded parameters (DTensors) keep
    the stacked names, which torch.distributed.checkpoint needs to be parameters."""

    def __init__(self, experts: int, inputs: int, width: int) -> None:
        super().__init__()
        if inputs % ALIGNMENT or width % ALIGNMENT:
            raise ValueError(f"grouped expert GEMMs need expert inputs ({inputs}) and width ({width}) in multiples "
                             f"of {ALIGNMENT} (moe_latent_size or hidden_size, moe_intermediate_size)")
        self.up_proj = nn.Parameter(torch.empty(experts, width, inputs))
        self.down_proj = nn.Parameter(torch.empty(experts, inputs, width))
        with torch.no_grad():  # as one nn.Linear per expert would be, in the same order
            for expert in range(experts):
                for weight in (self.up_proj[expert], self.down_proj[expert]):
                    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        self.register_state_dict_post_hook(_split_stacked)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_stack_split)  # type: ignore[no-untyped-call]

    def __len__(self) -> int:
        return self.up_proj.shape[0]

    def __getitem__(self, index: int) -> ReluSquaredMlp:
        """Expert `index` as a module whose weights are views of the stacked ones (writing them writes these)."""
        with torch.device("meta"):
            expert = ReluSquaredMlp(self.up_proj.shape[2], self.up_proj.shape[1])
        for name in PROJECTIONS:
            getattr(expert, name).weight = nn.Parameter(getattr(self, name).detach()[index], requires_grad=False)
        return expert

    def unstacked(self) -> ExpertList:
        return ExpertList(self[index] for index in range(len(self)))

    def forward(self, latent: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for [tokens, inputs] `latent`, routed by [tokens, top_k] `weights` and
        `chosen` experts; in the dtype of `weights`. The GEMMs run in the autocast dtype under autocast (which
        does not cover grouped GEMMs), else in the weights' dtype."""
        device = latent.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.up_proj.dtype
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        ends = torch.bincount(flat, minlength=len(self)).cumsum(0).to(torch.int32)
        rows = order // chosen.shape[1]
        up, down = (self.up_proj.to(dtype).transpose(1, 2), self.down_proj.to(dtype).transpose(1, 2))
        inner = F.relu(F.grouped_mm(latent[rows].to(dtype), up, offs=ends)).square()
        out = F.grouped_mm(inner, down, offs=ends) * weights.flatten()[order, None]
        return torch.zeros(latent.shape, dtype=out.dtype, device=latent.device).index_add_(0, rows, out)


def expert_names(prefix: str, projection: str, experts: int) -> list[str]:
    """Checkpoint names of a stacked projection's experts."""
    return [f"{prefix}{expert}.{projection}.weight" for expert in range(experts)]


def split_stacked(state: dict[str, torch.Tensor], prefix: str) -> None:
    """Replace `Experts` weights stacked under `prefix` in `state` by one entry per expert (views)."""
    stacked = {name: state[prefix + name] for name in PROJECTIONS if prefix + name in state}
    if not stacked or any(isinstance(tensor, DTensor) for tensor in stacked.values()):
        return
    for name in stacked:
        del state[prefix + name]
    for expert in range(len(next(iter(stacked.values())))):
        state.update({f"{prefix}{expert}.{name}.weight": tensor[expert] for name, tensor in stacked.items()})


def _split_stacked(module: nn.Module, state: dict[str, torch.Tensor], prefix: str, metadata: object) -> None:
    split_stacked(state, prefix)


def _stack_split(module: nn.Module, state: dict[str, torch.Tensor], prefix: str, *_: object) -> None:
    """A state dict naming each expert, as checkpoints do, loads into the stacked weights."""
    assert isinstance(module, Experts)
    for projection in PROJECTIONS:
        names = expert_names(prefix, projection, len(module))
        if all(name in state for name in names):
            state[prefix + projection] = torch.stack([state.pop(name) for name in names])


def unstack_experts(model: nn.Module) -> None:
    """Give every mixture of experts in `model` one module per expert (`ExpertList`), for modelopt."""
    for module in model.modules():
        if isinstance(module, MixtureOfExperts) and isinstance(module.experts, Experts):
            module.experts = module.experts.unstacked()


class MixtureOfExperts(nn.Module):
    """Router on the hidden state; routed ReLU^2 experts (in the latent space if any); a shared expert."""

    experts: Experts | ExpertList

    def __init__(self, part: Moe, hidden: int, routing: Routing) -> None:
        super().__init__()
        if part.gated:
            raise ValueError("NemotronH experts are ReLU^2 MLPs; a gated MoE has no modeling here")
        inner = part.latent_size or hidden
        self.part = part
        self.gate = Router(hidden, part.num_experts, part.top_k, routing)
        self.experts = Experts(part.num_experts, inner, part.expert_width)
        self.shared_experts = ReluSquaredMlp(hidden, part.shared_width) if part.shared_width else None
        self.fc1_latent_proj = nn.Linear(hidden, inner, bias=False) if part.latent_size else None
        self.fc2_latent_proj = nn.Linear(inner, hidden, bias=False) if part.latent_size else None

    def to_latent(self, flat: torch.Tensor) -> torch.Tensor:
        return flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)

    def routed(self, flat: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' weighted sum for [tokens, hidden] inputs, back in the hidden space."""
        weights, chosen = self.gate(flat, banned)
        latent = self.to_latent(flat)
        out: torch.Tensor = self.experts(latent, weights, chosen).to(latent.dtype)
        return out if self.fc2_latent_proj is None else self.fc2_latent_proj(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self.routed(flat)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)
