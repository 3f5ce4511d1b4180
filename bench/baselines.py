"""The baselines `bench/puzzle.py` holds Puzzle against, built from a Llama parent before the same GKD budget:

- **layer drop** (ShortGPT): whole layers removed in order of least Block Influence, 1 - cos(layer input,
  layer output) on calibration text;
- **width pruning in the Minitron style** (Muralidharan et al., 2024, "Compact Language Models via Pruning and
  Knowledge Distillation"): every layer keeps the same number of query heads per KV group and the same FFN
  width; heads are ranked by the L2 norm of their attention output and FFN channels by the magnitude of their
  activation (the input of down_proj), each summed over a sequence's tokens (L2) and averaged over calibration
  sequences, per layer. Key and value heads stay (the paper prunes query heads within their groups).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tailor.compressor.architecture import Attention, Block, Mlp, NoOp, Part
from tailor.compressor.checkpoint import read_config, write_checkpoint
from tailor.compressor.modeling import Branch, Decoder, GatedMlp, SelfAttention


@torch.no_grad()
def build(parent: Decoder, chosen: list[tuple[Part, Branch]]) -> Decoder:
    """A Decoder with one (part, branch) per parent slot; embeddings, final norm and head the parent's."""
    slots = parent.slots()
    parts = {(slot.layer, slot.kind): part for slot, (part, _) in zip(slots, chosen, strict=True)}
    blocks = [Block(mixer=parts.get((i, "mixer")), ffn=parts.get((i, "ffn"))) for i in range(len(parent.arch.blocks))]
    child = Decoder(parent.arch.model_copy(update={"blocks": blocks}), parent.settings)
    child.embedding.load_state_dict(parent.embedding.state_dict())
    child.final_norm.load_state_dict(parent.final_norm.state_dict())
    if not parent.arch.tie_word_embeddings:
        child.lm_head.load_state_dict(parent.lm_head.state_dict())
    for slot, (_, source) in zip(child.slots(), chosen, strict=True):
        target = child.layer(slot).branch(slot.kind)
        assert (source is None) == (target is None), f"slot {slot.index}: branch does not match its part"
        for into, weights in zip(target or (), source or (), strict=True):
            into.load_state_dict(weights.state_dict())
    return child.to(parent.embedding.weight.dtype).eval()


@torch.no_grad()
def block_influence(parent: Decoder, ids: torch.Tensor) -> list[float]:
    """ShortGPT's Block Influence per layer: mean 1 - cos(layer input, layer output)."""
    x = parent.embed(ids)
    out = []
    for layer in parent.layers:
        y = layer(x)
        out.append(float((1 - torch.nn.functional.cosine_similarity(x, y, dim=-1)).mean()))
        x = y
    return out


@torch.no_grad()
def drop_layers(parent: Decoder, layers: set[int]) -> Decoder:
    return build(parent, [(NoOp(), None) if slot.layer in layers else (slot.part, parent.layer(slot).branch(slot.kind))
                          for slot in parent.slots()])


Importance = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [query heads], [FFN channels]


@torch.no_grad()
def minitron_importance(parent: Decoder, ids: torch.Tensor, batch: int) -> Importance:
    """Per layer, each query head's and each FFN channel's importance on the calibration sequences `ids`."""
    sums: dict[int, list[torch.Tensor]] = {}

    def record(index: int, scores: torch.Tensor) -> None:
        sums[index] = [sums[index][0] + scores] if index in sums else [scores]

    hooks = []
    for number, layer in enumerate(parent.layers):
        attention, ffn = layer.self_attn, layer.mlp
        if not isinstance(attention, SelfAttention) or not isinstance(ffn, GatedMlp):
            raise ValueError(f"layer {number}: the Minitron baseline prunes Llama layers (attention and SwiGLU)")
        heads, head_dim = attention.heads, attention.head_dim
        hooks.append(attention.o_proj.register_forward_pre_hook(
            lambda _, args, n=2 * number, h=heads, d=head_dim: record(
                n, args[0].unflatten(-1, (h, d)).norm(dim=-1).norm(dim=1).sum(0))))
        hooks.append(ffn.down_proj.register_forward_pre_hook(
            lambda _, args, n=2 * number + 1: record(n, args[0].abs().norm(dim=1).sum(0))))
    try:
        for start in range(0, len(ids), batch):
            parent(ids[start:start + batch])
    finally:
        for hook in hooks:
            hook.remove()
    return [(sums[2 * n][0] / len(ids), sums[2 * n + 1][0] / len(ids)) for n in range(len(parent.layers))]


@torch.no_grad()
def minitron(parent: Decoder, importance: Importance, heads_per_group: int, width: int) -> Decoder:
    """Every layer cut to `heads_per_group` query heads per KV group and `width` FFN channels, its most
    important ones kept (in their order)."""
    chosen: list[tuple[Part, Branch]] = []
    for slot in parent.slots():
        norm, op = parent.layer(slot).branch(slot.kind) or (None, None)
        heads, channels = importance[slot.layer]
        if slot.kind == "mixer":
            assert isinstance(slot.part, Attention) and isinstance(op, SelfAttention)
            part: Part = slot.part.model_copy(update={"num_heads": slot.part.num_kv_heads * heads_per_group})
            group = slot.part.num_heads // slot.part.num_kv_heads
            keep = torch.cat([g * group + heads[g * group:(g + 1) * group].topk(heads_per_group).indices.sort().values
                              for g in range(slot.part.num_kv_heads)])
            rows = (keep[:, None] * op.head_dim + torch.arange(op.head_dim)).flatten()
            new = SelfAttention(part, parent.arch.hidden_size, parent.settings.rope_theta).to(op.q_proj.weight.dtype)
            new.q_proj.weight.copy_(op.q_proj.weight[rows])
            new.k_proj.load_state_dict(op.k_proj.state_dict())
            new.v_proj.load_state_dict(op.v_proj.state_dict())
            new.o_proj.weight.copy_(op.o_proj.weight[:, rows])
        else:
            assert isinstance(slot.part, Mlp) and isinstance(op, GatedMlp)
            part = Mlp(intermediate_size=width, gated=True)
            keep = channels.topk(width).indices.sort().values
            new = GatedMlp(parent.arch.hidden_size, width).to(op.down_proj.weight.dtype)
            new.gate_proj.weight.copy_(op.gate_proj.weight[keep])
            new.up_proj.weight.copy_(op.up_proj.weight[keep])
            new.down_proj.weight.copy_(op.down_proj.weight[:, keep])
        chosen.append((part, (norm, new)))
    return build(parent, chosen)


def save_minitron(model: Decoder, folder: Path, parent: Path) -> None:
    """A Minitron child as a plain Llama checkpoint of the parent's (uniform layers: the head count and FFN width
    are the model-wide fields, the head size stated since it no longer follows from them)."""
    first = model.arch.blocks[0]
    assert isinstance(first.mixer, Attention) and isinstance(first.ffn, Mlp)
    config: dict[str, Any] = {**read_config(parent), "num_attention_heads": first.mixer.num_heads,
                              "head_dim": first.mixer.head_dim, "intermediate_size": first.ffn.intermediate_size}
    write_checkpoint(model, folder, config, parent)
