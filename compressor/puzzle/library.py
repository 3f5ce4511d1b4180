"""Stage 1, the block library: replacement variants for every slot, initialised from the current block.

- Attention: fewer KV heads (each new head the mean of a group of old ones).
- FFN (gated or ReLU^2): narrower widths keeping the channels with the largest contribution
  |X_i| * ||W_down[:, i]|| (Puzzle's channel contribution).
- Mamba-2: fewer heads (the same count in every group), a smaller head dim, a smaller SSM state; heads
  and head-dim channels ranked by their contribution to out_proj, state channels by mean |B_n * C_n|.
- MoE: fewer routed experts (ranked by how much removing each changes the routed output), narrower
  experts (channel contribution on the tokens routed to each), a smaller top-k, a narrower shared expert.
- Any block: one linear map, or removal. Linear maps start at the least-squares fit of the block's
  output on the calibration activations (the optimum of an unnormalised local-distillation loss), at
  least as close as the paper's W_up.W_down / W_V.W_O products. For a child served by vLLM (the plan's
  `engine`) neither a linear map nor removing the first block's attention is offered, nor, in a hybrid, removing
  a block or a Mamba shape other than a smaller state: vLLM cannot load them.
Which sizes each slot is offered: `options.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field

from tailor.compressor.model.architecture import Attention, Linear, Mamba, Mlp, Moe, NoOp, Part
from tailor.compressor.model.mamba import Mamba2
from tailor.compressor.model.modeling import (
    Branch,
    GatedMlp,
    LinearAttention,
    LinearMlp,
    ModelSettings,
    SelfAttention,
    Slot,
    build_branch,
    residual,
)
from tailor.compressor.model.moe import MixtureOfExperts, ReluSquaredMlp
from tailor.compressor.puzzle.options import part_options
from tailor.compressor.puzzle.plan import Library
from tailor.compressor.sizing.engines import Engine


class Variant(BaseModel):
    """One candidate for one slot."""

    model_config = ConfigDict(frozen=True)

    slot: int
    kind: str
    part: Annotated[Attention | Mamba | Mlp | Moe | Linear | NoOp, Field(discriminator="kind")]
    is_current: bool = False

    @property
    def state(self) -> int | None:
        """The SSM state size of a Mamba variant (one size for every Mamba block)."""
        return self.part.state_size if isinstance(self.part, Mamba) else None

    @property
    def label(self) -> str:
        return part_label(self.part)


def part_label(part: Part) -> str:
    """Short name of a sub-layer choice: kv<heads>; w<width>; h<heads>d<head dim>s<state> (Mamba);
    e<experts>k<top-k>w<expert width>s<shared width> (MoE); linear; noop."""
    if isinstance(part, Attention):
        return f"kv{part.num_kv_heads}"
    if isinstance(part, Mlp):
        return f"w{part.intermediate_size}"
    if isinstance(part, Mamba):
        return f"h{part.num_heads}d{part.head_dim}s{part.state_size}"
    if isinstance(part, Moe):
        return f"e{part.num_experts}k{part.top_k}w{part.expert_width}s{part.shared_width}"
    return "linear" if isinstance(part, Linear) else "noop"


def slot_variants(slot: Slot, parent_part: Part, library: Library, engine: Engine = Engine.VLLM,
                  hybrid: bool = False) -> list[Variant]:
    """The slot's options (`options.part_options`: the current part first) as variants."""
    options = part_options(slot.part, parent_part, slot.layer, library, engine, hybrid)
    return [Variant(slot=slot.index, kind=slot.kind, part=p, is_current=i == 0) for i, p in enumerate(options)]


def _least_squares(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], ridge: float = 1e-3) -> torch.Tensor:
    """W (out x in) minimising ||Y - X W^T||^2 + ridge * trace(X^T X)/n * ||W||^2 over (X, Y) chunks of rows: the
    normal equations are summed chunk by chunk, in float64."""
    sums: list[torch.Tensor] = []
    for inputs, outputs in pairs:
        x, y = inputs.reshape(-1, inputs.shape[-1]).double(), outputs.reshape(-1, outputs.shape[-1]).double()
        sums = [x.T @ x, x.T @ y] if not sums else [sums[0] + x.T @ x, sums[1] + x.T @ y]
    assert sums, "no calibration rows"
    gram, cross = sums
    gram += torch.eye(gram.shape[0], dtype=gram.dtype) * ridge * gram.diagonal().mean()
    result: torch.Tensor = torch.linalg.solve(gram, cross).T.float()
    return result


def _pool_heads(weight: torch.Tensor, heads: int, new_heads: int, head_dim: int) -> torch.Tensor:
    """Mean of each group of `heads // new_heads` consecutive heads of a K or V projection."""
    return weight.view(new_heads, heads // new_heads, head_dim, -1).mean(1).reshape(new_heads * head_dim, -1)


class NormedRows:
    """A slot's calibration rows through its norm, `rows` sequences at a time, computed as they are read (each
    statistic reads them once): no part's activations are ever held for every captured row at once."""

    def __init__(self, norm: torch.nn.Module, inputs: torch.Tensor, rows: int) -> None:
        self.norm, self.chunks = norm, torch.split(inputs, rows)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self.norm(chunk) for chunk in self.chunks)


class _TokenMean:
    """The mean over tokens of a per-token statistic, added up a chunk of tokens at a time."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.tokens = 0

    def add(self, per_token: torch.Tensor) -> None:
        """`per_token`: [tokens, ...] values of the statistic."""
        chunk = per_token.double().sum(0)
        self.total = chunk if self.total is None else self.total + chunk
        self.tokens += per_token.shape[0]

    def mean(self) -> torch.Tensor:
        assert self.total is not None and self.tokens > 0, "no calibration tokens"
        return (self.total / self.tokens).float()


@torch.no_grad()
def init_variant(variant: Variant, current: Branch, inputs: torch.Tensor, settings: ModelSettings,
                 rows: int) -> Branch:
    """A new branch for `variant`, initialised from the `current` branch on calibration residuals `inputs`
    ([sequences, tokens, hidden]), read `rows` sequences at a time."""
    if variant.is_current:
        return copy.deepcopy(current)
    hidden = inputs.shape[-1]
    with torch.device(inputs.device):  # where the current branch and its inputs are (a GPU in a real run)
        branch = build_branch(variant.kind, variant.part, hidden, settings)
    if branch is None:
        return None
    assert current is not None
    norm, op = branch
    old_norm, old_op = current
    norm.load_state_dict(old_norm.state_dict())
    normed = NormedRows(old_norm, inputs, rows)
    if isinstance(op, LinearAttention | LinearMlp):
        pairs = ((old_norm(x), residual(current, x) - x) for x in torch.split(inputs, rows))
        (op.linear_attn if isinstance(op, LinearAttention) else op.linear_mlp).weight.copy_(_least_squares(pairs))
    elif isinstance(op, SelfAttention):
        assert isinstance(old_op, SelfAttention)
        op.q_proj.load_state_dict(old_op.q_proj.state_dict())
        op.o_proj.load_state_dict(old_op.o_proj.state_dict())
        for name in ("k_proj", "v_proj"):
            pooled = _pool_heads(getattr(old_op, name).weight, old_op.kv_heads, op.kv_heads, op.head_dim)
            getattr(op, name).weight.copy_(pooled)
    elif isinstance(op, GatedMlp | ReluSquaredMlp):
        assert isinstance(old_op, GatedMlp | ReluSquaredMlp)
        keep_channels(old_op, op, channel_contribution(old_op, normed))
    elif isinstance(op, Mamba2):
        assert isinstance(old_op, Mamba2)
        prune_mamba(old_op, op, normed)
    elif isinstance(op, MixtureOfExperts):
        assert isinstance(old_op, MixtureOfExperts)
        prune_moe(old_op, op, normed)
    return branch


def channel_contribution(mlp: GatedMlp | ReluSquaredMlp, normed: Iterable[torch.Tensor]) -> torch.Tensor:
    """Puzzle's C_i = mean over tokens of |X_i| * ||W_down[:, i]||_2, X the input of down_proj."""
    activity = _TokenMean()
    for chunk in normed:
        activity.add(mlp.inner(chunk).abs().reshape(-1, mlp.down_proj.in_features))
    return _weighted_by_output(mlp, activity)


def _weighted_by_output(mlp: GatedMlp | ReluSquaredMlp, activity: _TokenMean) -> torch.Tensor:
    """C_i from the mean |X_i|: times the norm of down_proj's column i."""
    result: torch.Tensor = activity.mean() * mlp.down_proj.weight.norm(dim=0)
    return result


def keep_channels(old: GatedMlp | ReluSquaredMlp, new: GatedMlp | ReluSquaredMlp, contribution: torch.Tensor) -> None:
    """Copy the `new` width's most contributing channels of `old` into `new`."""
    keep = contribution.topk(new.down_proj.in_features).indices.sort().values
    for name in ("gate_proj", "up_proj"):
        if hasattr(new, name):
            getattr(new, name).weight.copy_(getattr(old, name).weight[keep])
    new.down_proj.weight.copy_(old.down_proj.weight[:, keep])


def prune_mamba(old: Mamba2, new: Mamba2, normed: Iterable[torch.Tensor]) -> None:
    """Keep the heads, head-dim channels and state channels of `old` that matter most, as `new` sizes them;
    `normed`: chunks of whole sequences ([batch, tokens, hidden])."""
    p, q = old.part, new.part
    output, coupling = _TokenMean(), _TokenMean()
    for chunk in normed:
        y, b, c = old.mix(chunk)
        output.add(y.abs().reshape(-1, p.inner))
        coupling.add((b.abs() * c.abs()).reshape(-1, p.n_groups, p.state_size))
    contribution = output.mean() * old.out_proj.weight.norm(dim=0)
    per_head = contribution.view(p.num_heads, p.head_dim)
    in_group, keep_in_group = p.num_heads // p.n_groups, q.num_heads // q.n_groups
    best = per_head.sum(1).view(p.n_groups, in_group).topk(keep_in_group, dim=1).indices.sort(dim=1).values
    heads = (best + torch.arange(p.n_groups)[:, None] * in_group).flatten()
    dims = per_head[heads].sum(0).topk(q.head_dim).indices.sort().values
    states = coupling.mean().topk(q.state_size, dim=1)
    state_rows = (states.indices.sort(dim=1).values + torch.arange(p.n_groups)[:, None] * p.state_size).flatten()
    inner = (heads[:, None] * p.head_dim + dims[None, :]).flatten()
    bc = p.n_groups * p.state_size
    conv = torch.cat([inner, p.inner + state_rows, p.inner + bc + state_rows])
    new.in_proj.weight.copy_(old.in_proj.weight[torch.cat([inner, p.inner + conv, p.inner + p.conv_dim + heads])])
    new.conv1d.weight.copy_(old.conv1d.weight[conv])
    assert new.conv1d.bias is not None and old.conv1d.bias is not None
    new.conv1d.bias.copy_(old.conv1d.bias[conv])
    for name in ("dt_bias", "A_log", "D"):
        getattr(new, name).copy_(getattr(old, name)[heads])
    new.norm.weight.copy_(old.norm.weight[inner])
    new.out_proj.weight.copy_(old.out_proj.weight[:, inner])


def prune_moe(old: MixtureOfExperts, new: MixtureOfExperts, normed: Iterable[torch.Tensor]) -> None:
    """Keep the experts whose removal changes the routed output most, then each one's most contributing
    channels (on the tokens routed to it, or on every token if none was); the shared expert by channel
    contribution; top-k as `new` has it. `normed` is read three times, a chunk at a time."""
    experts = old.part.num_experts
    change, routed_tokens = _TokenMean(), torch.zeros(experts, dtype=torch.long)
    for chunk in normed:
        flat = chunk.reshape(-1, chunk.shape[-1])
        full = old.routed(flat)
        change.add(torch.stack([(full - old.routed(flat, banned=torch.arange(experts) == e)).pow(2).sum(-1)
                                for e in range(experts)], dim=-1))
        routed_tokens += torch.bincount(old.gate(flat)[1].flatten().cpu(), minlength=experts)
    kept = change.mean().topk(new.part.num_experts).indices.sort().values
    new.gate.weight.copy_(old.gate.weight[kept])
    new.gate.e_score_correction_bias.copy_(old.gate.e_score_correction_bias[kept])
    activity = {expert: _TokenMean() for expert in kept.tolist()}
    for chunk in normed:
        flat = chunk.reshape(-1, chunk.shape[-1])
        _, chosen = old.gate(flat)
        latent = old.to_latent(flat)
        for expert, mean in activity.items():
            source = old.experts[expert]
            assert isinstance(source, ReluSquaredMlp)
            tokens = latent[(chosen == expert).any(-1)] if routed_tokens[expert] else latent
            mean.add(source.inner(tokens).abs())
    for index, (expert, mean) in enumerate(activity.items()):
        source, target = old.experts[expert], new.experts[index]
        assert isinstance(source, ReluSquaredMlp) and isinstance(target, ReluSquaredMlp)
        keep_channels(source, target, _weighted_by_output(source, mean))
    if new.shared_experts is not None and old.shared_experts is not None:
        shared = (chunk.reshape(-1, chunk.shape[-1]) for chunk in normed)
        keep_channels(old.shared_experts, new.shared_experts, channel_contribution(old.shared_experts, shared))
    for name in ("fc1_latent_proj", "fc2_latent_proj"):
        if getattr(new, name) is not None:
            getattr(new, name).load_state_dict(getattr(old, name).state_dict())
