"""What a child checkpoint carries beside its weights (`checkpoint.write_metadata`): no code but tailor's config
class, and its dtype under every key engines read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from tailor.compressor.model.architecture import Mlp, architecture_from_config
from tailor.compressor.model.checkpoint import TOKENIZER_FILES, CheckpointError, child_config, write_metadata
from tailor.compressor.tiny_hybrid import config as hybrid_config

FOREIGN = {"AutoConfig": "attacker/repo--configuration_evil.EvilConfig",
           "AutoModelForCausalLM": "attacker/repo--modeling_evil.EvilModel"}


@pytest.fixture
def hostile_parent(smollm2: Path, tmp_path: Path) -> Path:
    """SmolLM2's config and tokenizer files, each naming code on a model hub in `auto_map`."""
    parent = tmp_path / "parent"
    parent.mkdir()
    for name in (*TOKENIZER_FILES, "config.json"):
        if (smollm2 / name).exists():
            shutil.copy2(smollm2 / name, parent / name)
    for name, auto_map in (("config.json", FOREIGN),
                           ("tokenizer_config.json", {"AutoTokenizer": ["attacker/repo--tok.Evil", None]})):
        content = json.loads((parent / name).read_text())
        (parent / name).write_text(json.dumps({**content, "auto_map": auto_map}))
    return parent


def test_a_child_carries_no_code_of_its_parents(hostile_parent: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = json.loads((hostile_parent / "config.json").read_text())
    arch = architecture_from_config(config)
    narrower = arch.model_copy(update={"blocks": [arch.blocks[0].model_copy(update={"ffn": Mlp(
        intermediate_size=256, gated=True)}), *arch.blocks[1:]]})
    child = tmp_path / "child"
    child.mkdir()
    write_metadata(child, child_config(config, narrower), hostile_parent)
    written = json.loads((child / "config.json").read_text())
    assert written["auto_map"] == {"AutoConfig": "configuration_decilm.DeciLMConfig"}
    assert written["dtype"] == written["torch_dtype"] == "bfloat16"
    assert "auto_map" not in json.loads((child / "tokenizer_config.json").read_text())
    assert sorted(path.name for path in child.glob("*.py")) == ["configuration_decilm.py"]
    loaded = AutoConfig.from_pretrained(child, trust_remote_code=True)  # offline: only the child's own class
    assert type(loaded).__name__ == "DeciLMConfig" and loaded.block_configs[0].ffn.intermediate_size == 256
    assert AutoTokenizer.from_pretrained(child).encode("The capital of France") == \
        AutoTokenizer.from_pretrained(hostile_parent, trust_remote_code=False).encode("The capital of France")


def test_a_nemotron_h_child_gets_its_config_class_with_per_block_fields(tmp_path: Path, smollm2: Path) -> None:
    parent = {**hybrid_config(1000, 1, 2, dense=True), "auto_map": FOREIGN}
    arch = architecture_from_config(parent)
    blocks = list(arch.blocks)
    blocks[1] = blocks[1].model_copy(update={"ffn": Mlp(intermediate_size=64, gated=False)})
    write_metadata(tmp_path, child_config(parent, arch.model_copy(update={"blocks": blocks})), smollm2)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["auto_map"] == {"AutoConfig": "configuration_nemotron_h_puzzle.NemotronHPuzzleConfig"}
    loaded = AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
    assert loaded.get_nemotron_h_config_for_layer(1).intermediate_size == 64
    assert loaded.get_nemotron_h_config_for_layer(4).intermediate_size == parent["intermediate_size"]
    assert loaded.hybrid_override_pattern == parent["hybrid_override_pattern"]


def test_a_tokenizer_config_that_is_not_json_is_named(hostile_parent: Path, tmp_path: Path) -> None:
    (hostile_parent / "tokenizer_config.json").write_text("{not json")
    config = json.loads((hostile_parent / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: not JSON"):
        write_metadata(tmp_path, config, hostile_parent)


def test_a_tokenizer_file_linked_outside_the_parent_is_refused_not_copied(hostile_parent: Path,
                                                                          tmp_path: Path) -> None:
    """A tenant's claim whose tokenizer.json links to the stage's environment (its HF token) or another file of
    the pod: the child gets nothing of it. A link within the parent's folder is fine."""
    config = json.loads((hostile_parent / "config.json").read_text())
    (hostile_parent / "tokenizer.json").unlink()
    (hostile_parent / "tokenizer.json").symlink_to("/proc/self/environ")
    child = tmp_path / "child"
    child.mkdir()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: a symbolic link to /proc/.*outside the parent"):
        write_metadata(child, config, hostile_parent)
    assert not (child / "tokenizer.json").exists()
    (hostile_parent / "tokenizer.json").unlink()
    (hostile_parent / "vocab.json").write_text("{}")
    (hostile_parent / "tokenizer.json").symlink_to("vocab.json")
    write_metadata(child, config, hostile_parent)
    assert (child / "tokenizer.json").read_text() == "{}" and not (child / "tokenizer.json").is_symlink()


def test_a_hub_cache_snapshot_links_to_its_blobs(smollm2: Path, tmp_path: Path) -> None:
    """An hf:// parent as snapshot_download leaves it: every file a link into the repository's blobs."""
    repository = tmp_path / "hub" / "models--org--parent"
    snapshot, blobs = repository / "snapshots" / ("0" * 40), repository / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for index, name in enumerate(n for n in TOKENIZER_FILES if (smollm2 / n).exists()):
        shutil.copy2(smollm2 / name, blobs / str(index))
        (snapshot / name).symlink_to(Path("..", "..", "blobs", str(index)))
    config = json.loads((smollm2 / "config.json").read_text())
    write_metadata(tmp_path, config, snapshot)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("To be")
