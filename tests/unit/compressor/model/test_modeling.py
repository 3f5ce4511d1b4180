"""The project's modeling code: parity with transformers, the KV cache, heterogeneous checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tailor.compressor.model.architecture import Attention, Block, Linear, Mlp, NoOp, load_architecture
from tailor.compressor.model.checkpoint import CheckpointError, load_decoder, save_decoder
from tailor.compressor.model.modeling import Decoder

TINY = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300, "tie_word_embeddings": False, "rope_theta": 5000.0,
        "rms_norm_eps": 1e-6}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_logits_equal_transformers_llama(llama: Path) -> None:
    from transformers import LlamaForCausalLM

    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        reference = LlamaForCausalLM.from_pretrained(llama)(ids).logits
        ours = load_decoder(llama)(ids)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_the_kv_cache_decodes_what_a_full_forward_computes(llama: Path) -> None:
    model = load_decoder(llama)
    ids = torch.randint(0, 300, (2, 20))
    caches = model.new_caches(2, 20)
    with torch.no_grad():
        full = model(ids)
        model(ids[:, :15], caches)
        steps = [model(ids[:, t:t + 1], caches)[:, 0] for t in range(15, 20)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 15:], atol=1e-5, rtol=1e-5)


def child_of(model: Decoder) -> Decoder:
    arch = model.arch
    attention = arch.blocks[0].mixer
    assert isinstance(attention, Attention)
    blocks = [Block(mixer=attention.model_copy(update={"num_kv_heads": 1}), ffn=Mlp(intermediate_size=48, gated=True)),
              Block(mixer=Linear(), ffn=NoOp()), Block(mixer=NoOp(), ffn=Linear())]
    torch.manual_seed(2)
    return Decoder(arch.model_copy(update={"blocks": blocks}), model.settings)


def test_a_heterogeneous_child_round_trips_as_nemotron_nas(llama: Path, tmp_path: Path) -> None:
    child = child_of(load_decoder(llama))
    save_decoder(child, tmp_path / "child", llama)
    config = json.loads((tmp_path / "child" / "config.json").read_text())
    assert config["model_type"] == "nemotron-nas" and config["architectures"] == ["DeciLMForCausalLM"]
    assert config["block_configs"][0]["attention"]["n_heads_in_group"] == 4
    assert config["block_configs"][1]["attention"]["replace_with_linear"] is True
    assert config["block_configs"][2]["attention"]["no_op"] is True
    assert config["block_configs"][0]["ffn"]["intermediate_size"] == 48
    assert (tmp_path / "child" / "tokenizer.json").exists()
    names = set(load_file(tmp_path / "child" / "model.safetensors"))
    assert "model.layers.1.self_attn.linear_attn.weight" in names and "model.layers.2.mlp.linear_mlp.weight" in names
    assert not any(name.startswith("model.layers.2.self_attn") or "layers.2.input_layernorm" in name for name in names)
    loaded = load_decoder(tmp_path / "child")
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), child.to(torch.bfloat16).float()(ids), atol=1e-4, rtol=1e-4)
    arch = load_architecture(tmp_path / "child")
    assert arch.total_params == sum(p.numel() for p in loaded.parameters())
    assert arch.pattern == child.arch.pattern == "*-L00L"


def test_a_missing_folder_or_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such model folder"):
        load_decoder(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_decoder(tmp_path)


def test_an_unreadable_config_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: unreadable"):
        load_decoder(tmp_path)


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match=r"'model_type' is 'gpt2'; supported: llama, mistral .* nemotron-nas"):
        load_decoder(tmp_path)


def test_weights_that_do_not_match_the_config(llama: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((llama / "config.json").read_text())
    tensors = load_file(llama / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(8, 64)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing: model.layers.1.mlp.down_proj.weight; wrong shape: "
                                              r"model.layers.0.mlp.up_proj.weight"):
        load_decoder(tmp_path)


def test_a_corrupt_weights_file(llama: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((llama / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=r"model.safetensors: unreadable safetensors file"):
        load_decoder(tmp_path)
