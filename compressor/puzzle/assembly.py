"""Stage 6, assembly: the heterogeneous child from one chosen variant per slot, written layer by layer.

The child's `Architecture` holds the chosen parts; its checkpoint is written one layer (one safetensors
shard) at a time: a chosen current branch is copied from the current model's files, a trained one from its
BLD file, and embeddings, final norm and LM head last. `checkpoint.child_config` gives the per-block
`block_configs` (`nemotron-nas` for Llama parents, `nemotron_h_puzzle` for NemotronH ones).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tailor.compressor.model.architecture import Architecture, Block
from tailor.compressor.model.checkpoint import child_config, read_config
from tailor.compressor.model.lazy import LazyDecoder, sharded_checkpoint
from tailor.compressor.model.modeling import Decoder
from tailor.compressor.puzzle.bld import variant_branch
from tailor.compressor.puzzle.library import Variant


def child_architecture(current: Architecture, chosen: list[Variant], slots: list[tuple[int, str]]) -> Architecture:
    if [v.slot for v in chosen] != list(range(len(slots))):
        raise ValueError("assembly needs exactly one variant per slot, in slot order")
    parts = {slot: variant.part for slot, variant in zip(slots, chosen, strict=True)}
    blocks = [Block(mixer=parts.get((i, "mixer")), ffn=parts.get((i, "ffn"))) for i in range(len(current.blocks))]
    return current.model_copy(update={"blocks": blocks})


@torch.no_grad()
def assemble(current: LazyDecoder, chosen: list[Variant], bld: Path, folder: Path, parent: Path) -> Architecture:
    """Write the child into `folder` (config of the `parent` folder's family, its tokenizer files)."""
    slots = current.slots()
    arch = child_architecture(current.arch, chosen, [(s.layer, s.kind) for s in slots])
    with torch.device("meta"):
        expected = set(Decoder(arch, current.settings).state_dict())
    prefix = current.family_prefix
    written: set[str] = set()
    with sharded_checkpoint(folder, child_config(read_config(parent), arch), parent, len(arch.blocks) + 1) as out:
        for index in range(len(arch.blocks)):
            layer = current.layer(index)
            tensors: dict[str, torch.Tensor] = {}
            for slot, variant in ((s, chosen[s.index]) for s in slots if s.layer == index):
                branch = variant_branch(current, layer, variant, bld)
                if branch is None:
                    continue
                for name, module in zip(layer.branch_names(slot.kind), branch, strict=True):
                    tensors.update({f"{prefix}.layers.{index}.{name}.{key}": value
                                    for key, value in module.state_dict().items()})
            out.add(tensors)
            written.update(tensors)
            del layer
        ends = current.tensors(current.end_names(), dtype=torch.bfloat16)
        out.add(ends)
        written.update(ends)
        if written != expected - ({"lm_head.weight"} if arch.tie_word_embeddings else set()):
            raise ValueError(f"assembly wrote {sorted(written ^ expected)[:4]} unlike the child's architecture")
    return arch
