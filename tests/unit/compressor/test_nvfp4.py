"""NVFP4 emulation on CPU: packed as modelopt packs it, computed exactly from the packed tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tailor.compressor.architecture import Mamba, Moe, architecture_from_config
from tailor.compressor.checkpoint import settings_from_config
from tailor.compressor.memory import RECIPES
from tailor.compressor.modeling import Decoder
from tailor.compressor.quantize.nvfp4 import BLOCK, Nvfp4Linear, emulate, pack, tensor_group, unpack

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def weight(rows: int = 64, columns: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed))


def test_a_packed_weight_takes_four_and_a_half_bits_per_value() -> None:
    packed = pack(weight())
    assert packed.data.dtype == torch.uint8 and packed.data.shape == (64, 64)
    assert packed.scale.dtype == torch.float8_e4m3fn and packed.scale.shape == (64, 128 // BLOCK)
    assert packed.nbytes == 64 * 128 * 4.5 / 8 + 4


def test_every_value_is_an_e2m1_code_times_its_block_scale() -> None:
    packed = pack(weight())
    values = unpack(packed)
    scales = packed.scale.float().repeat_interleave(BLOCK, -1) * packed.global_scale
    codes = (values / scales).abs()
    assert torch.isin(codes, E2M1).all()
    relative = (values - weight()).norm() / weight().norm()
    assert 0.05 < relative < 0.15  # FP4 is coarse, but not broken


def test_quantizing_a_quantized_tensor_changes_nothing() -> None:
    once = unpack(pack(weight()))
    twice = pack(once)
    torch.testing.assert_close(unpack(twice), once, rtol=0, atol=0)


def test_the_emulated_layer_computes_from_the_packed_weights_exactly() -> None:
    linear = nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight())
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(1))
    layer = Nvfp4Linear(linear, quantize_inputs=False)
    expected = x @ unpack(layer.packed).T
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    w4a4 = Nvfp4Linear(linear, quantize_inputs=True)
    torch.testing.assert_close(w4a4(x), unpack(pack(x)) @ unpack(w4a4.packed).T, rtol=0, atol=0)
    error = ((w4a4(x) - linear(x)).norm() / linear(x).norm()).item()
    assert error > ((layer(x) - linear(x)).norm() / linear(x).norm()).item()  # inputs quantized too: worse


def test_shapes_nvfp4_cannot_pack_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        pack(torch.randn(4, 20))
    with pytest.raises(ValueError, match="bias-free"):
        Nvfp4Linear(nn.Linear(32, 16, bias=True), quantize_inputs=False)


def test_a_recipe_quantizes_exactly_its_tensor_groups_at_the_bytes_the_memory_model_counts() -> None:
    config = {"model_type": "nemotron_h", "vocab_size": 96, "hidden_size": 64, "hybrid_override_pattern": "M*E-",
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 4,
              "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4, "n_routed_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
              "moe_latent_size": 32, "intermediate_size": 96}
    arch = architecture_from_config(config)
    assert isinstance(arch.blocks[0].mixer, Mamba) and isinstance(arch.blocks[2].ffn, Moe)
    torch.manual_seed(0)
    model = Decoder(arch, settings_from_config(config, "test")).eval()
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        reference = model(ids)
    recipe = RECIPES["nvfp4-mamba-moe"]
    packed = emulate(model, recipe)
    assert isinstance(model.backbone.layers[0].mixer.in_proj, Nvfp4Linear)  # Mamba projections: quantized
    assert type(model.backbone.layers[1].mixer.q_proj) is nn.Linear  # attention stays BF16 in this preset
    assert type(model.backbone.layers[2].mixer.fc1_latent_proj) is nn.Linear  # and so do latent projections
    assert isinstance(model.backbone.layers[2].mixer.experts[0].up_proj, Nvfp4Linear)
    assert type(model.lm_head) is nn.Linear
    quantized = sum(count for group, count in arch.params().items() if group in recipe.quantized)
    assert sum(p.nbytes - 4 for p in packed.values()) == quantized * 4.5 / 8
    with torch.no_grad():
        emulated = model(ids)
    assert 0 < (emulated - reference).abs().max() < reference.abs().max()
    with pytest.raises(ValueError, match="not nvfp4"):
        emulate(model, RECIPES["fp8"])


def test_every_linear_layer_of_the_modeling_has_a_tensor_group() -> None:
    names = {"lm_head": "lm_head", "model.layers.0.self_attn.q_proj": "attention",
             "model.layers.0.self_attn.linear_attn": "linear", "model.layers.3.mlp.down_proj": "mlp",
             "backbone.layers.0.mixer.in_proj": "mamba_proj", "backbone.layers.2.mixer.experts.7.up_proj": "experts",
             "backbone.layers.2.mixer.shared_experts.down_proj": "shared_experts",
             "backbone.layers.2.mixer.fc2_latent_proj": "latent", "backbone.layers.3.mixer.up_proj": "mlp"}
    assert {name: tensor_group(name).value for name in names} == names
