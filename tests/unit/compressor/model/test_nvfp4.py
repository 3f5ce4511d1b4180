"""NVFP4 on CPU: packed as modelopt packs it, computed exactly from the packed tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tailor.compressor.model.nvfp4 import BLOCK, Nvfp4Linear, pack, unpack
from tailor.compressor.quantize.recipes import tensor_group

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


def test_the_layer_computes_from_the_packed_weights_exactly() -> None:
    linear = nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight())
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(1))
    layer = Nvfp4Linear.from_linear(linear)
    expected = x @ unpack(layer.packed()).T
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    input_scale = x.abs().max() / (6 * 448)  # modelopt's global scale for a calibrated amax
    w4a4 = Nvfp4Linear.from_linear(linear, input_scale)
    torch.testing.assert_close(w4a4(x), unpack(pack(x, input_scale)) @ unpack(w4a4.packed()).T, rtol=0, atol=0)
    error = ((w4a4(x) - linear(x)).norm() / linear(x).norm()).item()
    assert error > ((layer(x) - linear(x)).norm() / linear(x).norm()).item()  # inputs quantized too: worse


def test_shapes_nvfp4_cannot_pack_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        pack(torch.randn(4, 20))
    with pytest.raises(ValueError, match="bias-free"):
        Nvfp4Linear.from_linear(nn.Linear(32, 16, bias=True))
    with pytest.raises(ValueError, match="multiple of 16"):
        Nvfp4Linear(20, 16, quantize_inputs=False)


def test_every_linear_layer_of_the_modeling_has_a_tensor_group() -> None:
    names = {"lm_head": "lm_head", "model.layers.0.self_attn.q_proj": "attention",
             "model.layers.0.self_attn.linear_attn": "linear", "model.layers.3.mlp.down_proj": "mlp",
             "backbone.layers.0.mixer.in_proj": "mamba_proj", "backbone.layers.2.mixer.experts.7.up_proj": "experts",
             "backbone.layers.2.mixer.shared_experts.down_proj": "shared_experts",
             "backbone.layers.2.mixer.fc2_latent_proj": "latent", "backbone.layers.3.mixer.up_proj": "mlp"}
    assert {name: tensor_group(name).value for name in names} == names
