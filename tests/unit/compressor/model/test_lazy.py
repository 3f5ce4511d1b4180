"""Models read and written layer by layer: the same logits as the whole model, and sharded checkpoints that
load back whole."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tailor.compressor.model.checkpoint import CheckpointError, load_decoder, read_config
from tailor.compressor.model.lazy import INDEX_FILE, LazyDecoder, sharded_checkpoint, sweep
from tailor.compressor.model.moe import Experts


@pytest.mark.parametrize("which", ["tiny_parent", "tiny_hybrid"])
def test_a_sweep_one_layer_at_a_time_gives_the_whole_models_logits(which: str,
                                                                     request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue(which)
    whole, lazy = load_decoder(folder).eval(), LazyDecoder(folder)
    ids = torch.randint(0, whole.arch.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    entered: list[int] = []
    with torch.no_grad():
        streamed = lazy.head()(sweep(lazy, lazy.embedding()(ids), lambda slot, x: entered.append(slot.index)))
        torch.testing.assert_close(streamed, whole(ids), rtol=0, atol=0)
        torch.testing.assert_close(lazy.load()(ids), whole(ids), rtol=0, atol=0)
    assert entered == [slot.index for slot in whole.slots()]
    assert all(p.device.type == "meta" for p in lazy.skeleton.parameters())  # the skeleton holds no weights


def test_a_sharded_checkpoint_has_one_file_per_group_and_loads_whole(tiny_parent: Path, tmp_path: Path) -> None:
    lazy = LazyDecoder(tiny_parent)
    groups = [[name for name in lazy.shapes if name.startswith(lazy.layer_prefix(i))]
              for i in range(len(lazy.arch.blocks))]
    groups.append([name for name in lazy.files if not name.startswith(f"{lazy.family_prefix}.layers.")])
    with sharded_checkpoint(tmp_path / "copy", read_config(tiny_parent), tiny_parent, len(groups)) as writer:
        for names in groups:
            writer.add(lazy.tensors(names))
    assert len(list((tmp_path / "copy").glob("model-*-of-*.safetensors"))) == len(groups)
    assert (tmp_path / "copy" / INDEX_FILE).exists()
    copy, original = load_decoder(tmp_path / "copy"), load_decoder(tiny_parent)
    for (name, a), b in zip(copy.state_dict().items(), original.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b.to(torch.bfloat16).float(), msg=name)


def test_a_missing_tensor_is_named(tiny_parent: Path, tmp_path: Path) -> None:
    lazy = LazyDecoder(tiny_parent)
    with sharded_checkpoint(tmp_path / "broken", read_config(tiny_parent), tiny_parent, 1) as writer:
        writer.add(lazy.tensors([name for name in lazy.files if not name.endswith("layers.1.mlp.up_proj.weight")]))
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.1\.mlp\.up_proj\.weight"):
        LazyDecoder(tmp_path / "broken")


def test_stacked_experts_are_read_in_expert_order_whatever_file_holds_each(tiny_hybrid: Path, tmp_path: Path) -> None:
    """A layer's routed experts are read an expert at a time into their stacked tensor (`LazyDecoder.stacked`),
    checkpoints keeping any expert in any shard."""
    lazy = LazyDecoder(tiny_hybrid)
    odd = [name for name in lazy.files if re.search(r"\.experts\.\d*[13579]\.", name)]
    assert odd
    groups = [odd, [name for name in lazy.files if name not in odd]]  # experts 1, 3, ... in the first file
    with sharded_checkpoint(tmp_path / "copy", read_config(tiny_hybrid), tiny_hybrid, len(groups)) as writer:
        for names in groups:
            writer.add(lazy.tensors(names))
    copy = LazyDecoder(tmp_path / "copy")
    for index in range(len(lazy.arch.blocks)):
        ours, theirs = copy.layer(index).state_dict(), lazy.layer(index).state_dict()
        assert list(ours) == list(theirs) and all(torch.equal(ours[name], theirs[name]) for name in ours)
    stacked = [(index, name, module) for index in range(len(lazy.arch.blocks))
               for name, module in copy.layer(index).named_modules() if isinstance(module, Experts)]
    assert stacked
    original = load_decoder(tiny_hybrid).state_dict()
    for index, name, module in stacked:
        assert torch.equal(module.up_proj[1], original[f"{lazy.layer_prefix(index)}{name}.1.up_proj.weight"])
