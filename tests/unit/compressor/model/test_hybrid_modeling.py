"""NemotronH modeling: parity with transformers both ways, the Mamba/KV caches, nemotron_h_puzzle children."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tailor.compressor.model.architecture import Attention, Block, Linear, Mamba, Mlp, Moe, NoOp, load_architecture
from tailor.compressor.model.checkpoint import CheckpointError, load_decoder, save_decoder, write_checkpoint
from tailor.compressor.model.modeling import Decoder
from tailor.compressor.tiny_hybrid import build

VOCAB = 101
BASE: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "hybrid_override_pattern": "M*EM-E", "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2,
    "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 8, "intermediate_size": 96, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
    "max_position_embeddings": 256, "time_step_min": 0.001, "time_step_max": 0.1,
}
VARIANTS = {  # a latent MoE with one routing group; a plain MoE routed within the best of two groups
    "latent": {"moe_latent_size": 32},
    "grouped": {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": False},
}


def transformers_checkpoint(folder: Path, **changes: Any) -> Path:
    """A random NemotronH written by transformers itself, with weights large enough to route and mix."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(**{**BASE, **changes})).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")):
                weight.uniform_(0.5, 1.5)
            else:
                weight.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_equal_transformers_nemotron_h(variant: str, tmp_path: Path) -> None:
    from transformers import NemotronHForCausalLM

    folder = transformers_checkpoint(tmp_path, **VARIANTS[variant])
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = NemotronHForCausalLM.from_pretrained(folder).eval()(ids).logits
        ours = load_decoder(folder)(ids)
    assert reference.std() > 0.2  # not a degenerate model that anything would match
    print(f"{variant}: max |dlogit| {(ours - reference).abs().max():.1e}, logit std {reference.std():.2f}")
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)
    assert load_architecture(folder).total_params == sum(p.numel() for p in load_decoder(folder).parameters())


def test_mamba_and_kv_caches_decode_what_a_full_forward_computes(tmp_path: Path) -> None:
    model = load_decoder(transformers_checkpoint(tmp_path, **VARIANTS["latent"]))
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    caches = model.new_caches(2, 24)
    assert {type(c).__name__ for c in caches} == {"MambaCache", "KVCache", "NoneType"}
    with torch.no_grad():
        full = model(ids)
        model(ids[:, :17], caches)
        steps = [model(ids[:, t:t + 1], caches)[:, 0] for t in range(17, 24)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 17:], atol=1e-5, rtol=1e-5)


def test_transformers_loads_what_the_project_writes(tmp_path: Path) -> None:
    from transformers import NemotronHForCausalLM

    config = {**BASE, **VARIANTS["latent"], "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
              "use_conv_bias": True}
    model = build(config, seed=3)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.normal_(0.0, 0.2)
    write_checkpoint(model, tmp_path / "ours", config, tmp_path)
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = NemotronHForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()(ids).logits
        ours = load_decoder(tmp_path / "ours")(ids)
    assert reference.std() > 0.2
    print(f"written by the project: max |dlogit| {(ours - reference).abs().max():.1e}, logit std "
          f"{reference.std():.2f}")
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)


def heterogeneous_child(parent: Decoder) -> Decoder:
    mamba, attention, moe = (parent.arch.blocks[i].mixer or parent.arch.blocks[i].ffn for i in (0, 1, 2))
    assert isinstance(mamba, Mamba) and isinstance(attention, Attention) and isinstance(moe, Moe)
    blocks = [Block(mixer=mamba.model_copy(update={"num_heads": 4, "state_size": 12})),
              Block(mixer=attention.model_copy(update={"num_kv_heads": 1})),
              Block(ffn=moe.model_copy(update={"num_experts": 6, "top_k": 1, "expert_width": 16})),
              Block(mixer=mamba.model_copy(update={"head_dim": 4, "state_size": 12})),
              Block(ffn=Linear()), Block(ffn=NoOp())]
    torch.manual_seed(4)
    return Decoder(parent.arch.model_copy(update={"blocks": blocks}), parent.settings)


def test_children_are_nemotron_h_puzzle_folders_that_load_back_exactly(tmp_path: Path) -> None:
    parent_dir = transformers_checkpoint(tmp_path / "parent", **VARIANTS["latent"])
    child = heterogeneous_child(load_decoder(parent_dir))
    save_decoder(child, tmp_path / "child", parent_dir)
    config = json.loads((tmp_path / "child" / "config.json").read_text())
    assert config["model_type"] == "nemotron_h_puzzle"
    assert config["architectures"] == ["NemotronHPuzzleForCausalLM"]
    assert [entry["block_type"] for entry in config["block_configs"]] == ["mamba", "attention", "moe", "mamba",
                                                                         "mlp", "moe"]
    assert config["block_configs"][4]["replace_with_linear"] and config["block_configs"][5]["no_op"]
    assert config["ssm_state_size"] == 12  # the one state size, model-wide, for engines that read only that
    loaded = load_decoder(tmp_path / "child")
    assert loaded.arch.blocks == child.arch.blocks
    ids = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), child.to(torch.bfloat16).float()(ids), atol=1e-4, rtol=1e-4)
    assert load_architecture(tmp_path / "child").total_params == sum(p.numel() for p in loaded.parameters())


@pytest.mark.parametrize(("field", "value"), [("mlp_hidden_act", "silu"), ("use_conv_bias", False)])
def test_nemotron_h_options_the_modeling_lacks_are_named(field: str, value: Any, tmp_path: Path) -> None:
    folder = transformers_checkpoint(tmp_path, **VARIANTS["latent"])
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(CheckpointError, match=field):
        load_decoder(folder)


def test_a_block_type_that_contradicts_the_pattern_is_named(tmp_path: Path) -> None:
    parent_dir = transformers_checkpoint(tmp_path / "parent", **VARIANTS["latent"])
    save_decoder(heterogeneous_child(load_decoder(parent_dir)), tmp_path / "child", parent_dir)
    config = json.loads((tmp_path / "child" / "config.json").read_text())
    config["block_configs"][0]["block_type"] = "moe"
    (tmp_path / "child" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"block_configs\[0\]\.block_type"):
        load_decoder(tmp_path / "child")


def test_blocks_are_one_part_each() -> None:
    config = {**BASE, "model_type": "nemotron_h"}
    model = build(config)
    assert [slot.kind for slot in model.slots()] == ["mixer", "mixer", "ffn", "mixer", "ffn", "ffn"]
    assert all(name.startswith(("backbone.", "lm_head.")) for name in model.state_dict())
    with pytest.raises(ValueError, match="exactly one part"):
        Decoder(model.arch.model_copy(update={"blocks": [Block(mixer=NoOp(), ffn=Mlp(intermediate_size=8,
                                                                                        gated=False))]}),
                model.settings)


def test_the_chunked_scan_equals_one_quadratic_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tailor.compressor.model import mamba

    model = load_decoder(transformers_checkpoint(tmp_path, **VARIANTS["latent"]))
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole = model(ids)
        monkeypatch.setattr(mamba, "CHUNK", 7)
        chunked = model(ids)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
