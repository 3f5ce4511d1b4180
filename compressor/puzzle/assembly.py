"""Stage 6, assembly: the heterogeneous child from one chosen variant per slot.

The child is a `Decoder` over a new `Architecture` whose blocks hold the chosen parts; embeddings,
final norm and every chosen branch's weights are copied in. `checkpoint.save_decoder` writes it with
per-block `block_configs` (`nemotron-nas` for Llama parents, `nemotron_h_puzzle` for NemotronH ones).
"""

from __future__ import annotations

import torch

from tailor.compressor.architecture import Block
from tailor.compressor.modeling import Branch, Decoder
from tailor.compressor.puzzle.library import Variant


@torch.no_grad()
def assemble(current: Decoder, chosen: list[Variant], branches: dict[tuple[int, str], Branch]) -> Decoder:
    slots = current.slots()
    if [v.slot for v in chosen] != [s.index for s in slots]:
        raise ValueError("assembly needs exactly one variant per slot, in slot order")
    parts = {(slot.layer, slot.kind): variant.part for slot, variant in zip(slots, chosen, strict=True)}
    blocks = [Block(mixer=parts.get((i, "mixer")), ffn=parts.get((i, "ffn"))) for i in range(len(current.arch.blocks))]
    child = Decoder(current.arch.model_copy(update={"blocks": blocks}), current.settings)
    child.embedding.load_state_dict(current.embedding.state_dict())
    child.final_norm.load_state_dict(current.final_norm.state_dict())
    if not current.arch.tie_word_embeddings:
        child.lm_head.load_state_dict(current.lm_head.state_dict())
    for slot, variant in zip(child.slots(), chosen, strict=True):
        source, target = branches[(variant.slot, variant.label)], child.layer(slot).branch(slot.kind)
        if (source is None) != (target is None):
            raise ValueError(f"slot {slot.index}: variant {variant.label} does not match the assembled block")
        if source is not None and target is not None:
            for into, weights in zip(target, source, strict=True):
                into.load_state_dict(weights.state_dict())
    return child.to(current.embedding.weight.dtype)
