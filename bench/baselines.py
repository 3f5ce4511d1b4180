"""The baselines `bench/puzzle.py` holds Puzzle against, built from a Llama parent before the same GKD budget:

- **block drop** (ShortGPT's Block Influence, 1 - cos(stream in, stream out) on calibration text, taken per
  attention and per FFN sub-block as He et al., 2024, "What Matters in Transformers? Not All Attention Is
  Needed", drop them): the sub-blocks of least influence removed, half a layer's step at a time;
- **width pruning in the Minitron style** (Muralidharan et al., 2024, "Compact Language Models via Pruning and
  Knowledge Distillation"): every layer keeps the same number of query heads per KV group and the same FFN
  width, and the model keeps fewer embedding channels. Heads are ranked by the L2 norm of their attention output,
  FFN channels by the magnitude of their activation (the input of down_proj), embedding channels by the
  magnitude of every RMSNorm's output, each summed over a sequence's tokens (L2) and averaged over calibration
  sequences (per layer; embedding channels over all layers). Key and value heads stay (the paper prunes query
  heads within their groups).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from tailor.compressor.model.architecture import Attention, Block, Mlp, NoOp, Part
from tailor.compressor.model.checkpoint import read_config, write_checkpoint
from tailor.compressor.model.modeling import Branch, Decoder, GatedMlp, RMSNorm, SelfAttention


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
    """ShortGPT's Block Influence per slot (attention or FFN sub-block): mean 1 - cos(stream in, stream out)."""
    x = parent.embed(ids)
    out = []
    for slot in parent.slots():
        y = parent.layer(slot).run_branch(slot.kind, x)
        out.append(float((1 - torch.nn.functional.cosine_similarity(x, y, dim=-1)).mean()))
        x = y
    return out


@torch.no_grad()
def drop_slots(parent: Decoder, slots: set[int]) -> Decoder:
    """The parent without the sub-blocks (slot indices) `slots`."""
    return build(parent, [(NoOp(), None) if slot.index in slots else (slot.part, parent.layer(slot).branch(slot.kind))
                          for slot in parent.slots()])


class Importance(NamedTuple):
    """Activation importance of every prunable unit, averaged over calibration sequences."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [query heads], [FFN channels]
    channels: torch.Tensor  # [embedding channels]


@torch.no_grad()
def minitron_importance(parent: Decoder, ids: torch.Tensor, batch: int) -> Importance:
    """Each query head's and FFN channel's importance per layer, and each embedding channel's, on the
    calibration sequences `ids`."""
    sums: dict[int, list[torch.Tensor]] = {}

    def record(index: int, scores: torch.Tensor) -> None:
        sums[index] = [sums[index][0] + scores] if index in sums else [scores]

    norms = [m for m in parent.modules() if isinstance(m, RMSNorm)]
    hooks = [norm.register_forward_hook(lambda _, __, out: record(-1, out.abs().norm(dim=1).sum(0))) for norm in norms]
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
    return Importance([(sums[2 * n][0] / len(ids), sums[2 * n + 1][0] / len(ids)) for n in range(len(parent.layers))],
                      sums[-1][0] / len(ids))


class Shape(NamedTuple):
    """A Minitron child's widths: query heads per KV group, FFN channels, embedding channels."""

    heads_per_group: int
    ffn: int
    hidden: int

    def __str__(self) -> str:
        return f"{self.heads_per_group} heads/group, ffn {self.ffn}, hidden {self.hidden}"


def minitron_shapes(parent: Decoder, step: int = 64) -> list[Shape]:
    """Every shape on the grid (widths in steps of `step`: FFN channels down to one step, embedding channels down
    to half the parent's, as far as the Minitron papers prune them), the most parameters first."""
    attention, ffn = parent.arch.blocks[0].mixer, parent.arch.blocks[0].ffn
    assert isinstance(attention, Attention) and isinstance(ffn, Mlp)
    group = attention.num_heads // attention.num_kv_heads
    shapes = [Shape(m, w, h) for m in range(group, 0, -1) for w in range(ffn.intermediate_size, step - 1, -step)
              for h in range(parent.arch.hidden_size, parent.arch.hidden_size // 2 - 1, -step)]

    def params(shape: Shape) -> int:
        per_layer = 2 * attention.num_kv_heads * (shape.heads_per_group + 1) * attention.head_dim + 3 * shape.ffn
        return int(shape.hidden * (len(parent.arch.blocks) * per_layer + parent.arch.vocab_size))

    return sorted(shapes, key=lambda shape: -params(shape))


@torch.no_grad()
def minitron(parent: Decoder, importance: Importance, shape: Shape) -> Decoder:
    """Every layer cut to the shape's query heads per KV group and FFN channels, and the model to its embedding
    channels, the most important ones kept (in their order)."""
    heads_per_group, width = shape.heads_per_group, shape.ffn
    chosen: list[tuple[Part, Branch]] = []
    for slot in parent.slots():
        norm, op = parent.layer(slot).branch(slot.kind) or (None, None)
        heads, channels = importance.layers[slot.layer]
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
    return narrow(build(parent, chosen), importance.channels.topk(shape.hidden).indices.sort().values)


@torch.no_grad()
def narrow(model: Decoder, keep: torch.Tensor) -> Decoder:
    """`model` with only the embedding channels `keep`: every tensor sliced along each dimension the hidden size
    sets (the only dimensions whose size changes with it)."""
    if len(keep) == model.arch.hidden_size:
        return model
    child = Decoder(model.arch.model_copy(update={"hidden_size": len(keep)}), model.settings)
    old = model.state_dict()
    for name, tensor in child.state_dict().items():
        source = old[name]
        for dim, (was, now) in enumerate(zip(source.shape, tensor.shape, strict=True)):
            if was != now:
                source = source.index_select(dim, keep)
        tensor.copy_(source)
    return child.to(model.embedding.weight.dtype).eval()


def save_minitron(model: Decoder, folder: Path, parent: Path) -> None:
    """A Minitron child as a plain Llama checkpoint of the parent's (uniform layers: the head count and FFN width
    are the model-wide fields, the head size stated since it no longer follows from them)."""
    first = model.arch.blocks[0]
    assert isinstance(first.mixer, Attention) and isinstance(first.ffn, Mlp)
    config: dict[str, Any] = {**read_config(parent), "hidden_size": model.arch.hidden_size,
                              "num_attention_heads": first.mixer.num_heads,
                              "head_dim": first.mixer.head_dim, "intermediate_size": first.ffn.intermediate_size}
    write_checkpoint(model, folder, config, parent)
