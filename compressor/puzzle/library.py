"""Stage 1, the block library: replacement variants for every slot, initialised from the current block.

Attention: fewer KV heads (each new head the mean of a group of old ones), one linear map, or removal.
FFN: narrower widths keeping the channels with the largest contribution |X_i| * ||W_down[:, i]||, one
linear map, or removal. Linear maps start at the least-squares fit of the block's output on the
calibration activations (the optimum of an unnormalised local-distillation loss), which is at least
as close as the paper's W_up.W_down / W_V.W_O products.
"""

from __future__ import annotations

import copy

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from tailor.compressor.architecture import Attention, Linear, Mlp, NoOp, Part
from tailor.compressor.modeling import (
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
from tailor.compressor.puzzle.plan import Library

WIDTH_MULTIPLE = 16


class Variant(BaseModel):
    """One candidate for one slot."""

    model_config = ConfigDict(frozen=True)

    slot: int
    kind: str
    part: Attention | Mlp | Linear | NoOp
    is_current: bool = False

    @property
    def label(self) -> str:
        return part_label(self.part)


def part_label(part: Part) -> str:
    """Short name of a sub-layer choice: kv<heads>, w<width>, linear or noop."""
    if isinstance(part, Attention):
        return f"kv{part.num_kv_heads}"
    if isinstance(part, Mlp):
        return f"w{part.intermediate_size}"
    return "linear" if isinstance(part, Linear) else "noop"


def slot_variants(slot: Slot, parent_part: Part, library: Library) -> list[Variant]:
    """The current part first, then every smaller option the library allows from it."""
    current = slot.part
    options: list[Part] = [current]
    if isinstance(current, Attention):
        counts = library.kv_heads or [n for n in range(1, current.num_kv_heads)
                                      if current.num_heads % n == 0]
        options += [current.model_copy(update={"num_kv_heads": n}) for n in sorted(set(counts), reverse=True)
                    if n < current.num_kv_heads and current.num_kv_heads % n == 0]
    elif isinstance(current, Mlp):
        assert isinstance(parent_part, Mlp)
        widths = {max(WIDTH_MULTIPLE, round(share * parent_part.intermediate_size / WIDTH_MULTIPLE) * WIDTH_MULTIPLE)
                  for share in library.ffn_widths}
        options += [Mlp(intermediate_size=w, gated=current.gated) for w in sorted(widths, reverse=True)
                    if w < current.intermediate_size]
    if library.linear and isinstance(current, Attention | Mlp):
        options.append(Linear())
    if library.no_op and not isinstance(current, NoOp):
        options.append(NoOp())
    return [Variant(slot=slot.index, kind=slot.kind, part=p, is_current=i == 0) for i, p in enumerate(options)]


def _least_squares(inputs: torch.Tensor, outputs: torch.Tensor, ridge: float = 1e-3) -> torch.Tensor:
    """W (out x in) minimising ||outputs - inputs W^T||^2 + ridge * trace(X^T X)/n * ||W||^2."""
    x, y = inputs.reshape(-1, inputs.shape[-1]).double(), outputs.reshape(-1, outputs.shape[-1]).double()
    gram = x.T @ x
    gram += torch.eye(gram.shape[0], dtype=gram.dtype) * ridge * gram.diagonal().mean()
    result: torch.Tensor = torch.linalg.solve(gram, x.T @ y).T.float()
    return result


def _pool_heads(weight: torch.Tensor, heads: int, new_heads: int, head_dim: int) -> torch.Tensor:
    """Mean of each group of `heads // new_heads` consecutive heads of a K or V projection."""
    return weight.view(new_heads, heads // new_heads, head_dim, -1).mean(1).reshape(new_heads * head_dim, -1)


@torch.no_grad()
def init_variant(variant: Variant, current: Branch, inputs: torch.Tensor, settings: ModelSettings) -> Branch:
    """A new branch for `variant`, initialised from the `current` branch on calibration residuals `inputs`."""
    if variant.is_current:
        return copy.deepcopy(current)
    hidden = inputs.shape[-1]
    branch = build_branch(variant.kind, variant.part, hidden, settings)
    if branch is None:
        return None
    assert current is not None
    norm, op = branch
    old_norm, old_op = current
    norm.load_state_dict(old_norm.state_dict())
    normed = old_norm(inputs)
    if isinstance(op, LinearAttention | LinearMlp):
        target = residual(current, inputs) - inputs
        weight = _least_squares(normed, target)
        (op.linear_attn if isinstance(op, LinearAttention) else op.linear_mlp).weight.copy_(weight)
    elif isinstance(op, SelfAttention):
        assert isinstance(old_op, SelfAttention)
        op.q_proj.load_state_dict(old_op.q_proj.state_dict())
        op.o_proj.load_state_dict(old_op.o_proj.state_dict())
        for name in ("k_proj", "v_proj"):
            pooled = _pool_heads(getattr(old_op, name).weight, old_op.kv_heads, op.kv_heads, op.head_dim)
            getattr(op, name).weight.copy_(pooled)
    elif isinstance(op, GatedMlp):
        assert isinstance(old_op, GatedMlp)
        keep = channel_contribution(old_op, normed).topk(op.down_proj.in_features).indices.sort().values
        op.gate_proj.weight.copy_(old_op.gate_proj.weight[keep])
        op.up_proj.weight.copy_(old_op.up_proj.weight[keep])
        op.down_proj.weight.copy_(old_op.down_proj.weight[:, keep])
    return branch


def channel_contribution(mlp: GatedMlp, normed: torch.Tensor) -> torch.Tensor:
    """Puzzle's C_i = mean over tokens of |X_i| * ||W_down[:, i]||_2, X the input of down_proj."""
    inner = nn.functional.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed)
    activity = inner.abs().reshape(-1, inner.shape[-1]).mean(0)
    result: torch.Tensor = activity * mlp.down_proj.weight.norm(dim=0)
    return result
