"""Loading a modelopt export into the project's `Decoder`, quantized layers and all.

Plain transformers does not: it warns "Unknown quantization type" and loads FP8 weights without their
scales. Here a layer is quantized exactly when the export holds a `weight_scale` for it; its format
comes from the stored weight (uint8: NVFP4 packed, float8_e4m3fn: FP8) and its inputs are quantized
when an `input_scale` is stored. With an FP8 KV cache, keys and values are rounded with the stored
`k_scale` / `v_scale`. The result is checked against `hf_quant_config.json`.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tailor.compressor.checkpoint import QUANT_ALGORITHMS, read_quant_config
from tailor.compressor.quantize.fp8 import Fp8Linear, Fp8Round
from tailor.compressor.quantize.nvfp4 import Nvfp4Linear


class QuantizedCheckpointError(ValueError):
    """A quantized export whose tensors and quantization config disagree; the message names the file."""


def swap_quantized_layers(model: nn.Module, tensors: dict[str, torch.Tensor], folder: Path,
                          dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Replace each linear layer the export quantized by its `Nvfp4Linear` / `Fp8Linear`, computing in `dtype`
    (their scales stay float32); return the format of each replaced layer. Call `refresh_quantized` after
    loading the state dict."""
    source = folder / "hf_quant_config.json"
    section = read_quant_config(folder)["quantization"]
    expected = QUANT_ALGORITHMS[section["quant_algo"]]
    excluded = section.get("exclude_modules") or []
    formats: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        is_excluded = any(fnmatch.fnmatchcase(name, pattern) for pattern in excluded)
        stored = tensors.get(f"{name}.weight")
        if f"{name}.weight_scale" not in tensors:
            if not is_excluded:
                raise QuantizedCheckpointError(f"{source}: {name} is stored unquantized but not in exclude_modules")
            continue
        if is_excluded:
            raise QuantizedCheckpointError(f"{source}: {name} is stored quantized but matches exclude_modules")
        if stored is not None and stored.dtype == torch.uint8:
            replacement: nn.Module = Nvfp4Linear(module.in_features, module.out_features,
                                                 quantize_inputs=f"{name}.input_scale" in tensors, dtype=dtype)
            kind = "nvfp4"
        else:
            replacement, kind = Fp8Linear(module.in_features, module.out_features, dtype), "fp8"
        if kind != expected:
            raise QuantizedCheckpointError(f"{source}: quant_algo is {section['quant_algo']} but {name} is "
                                           f"stored as {kind}")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, replacement)
        formats[name] = kind
    _restore_kv_cache(model, tensors, section, source)
    return formats


def _restore_kv_cache(model: nn.Module, tensors: dict[str, torch.Tensor], section: dict[str, Any],
                      source: Path) -> None:
    """Round keys and values as an FP8 KV cache does where the export says so; the scales are taken out of
    `tensors` (they live under `k_proj.k_scale` / `v_proj.v_scale`, not on a module of the modeling)."""
    algo = section.get("kv_cache_quant_algo")
    scales = sorted(name for name in tensors if name.endswith((".k_proj.k_scale", ".v_proj.v_scale")))
    if algo not in (None, "FP8"):
        raise QuantizedCheckpointError(f"{source}: field 'quantization.kv_cache_quant_algo' is {algo!r}; "
                                       "supported: FP8 or null")
    if bool(scales) != (algo == "FP8"):
        raise QuantizedCheckpointError(f"{source}: kv_cache_quant_algo is {algo} but the weights hold "
                                       f"{len(scales)} KV-cache scales")
    for name in scales:
        attention, leaf = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
        quantizer = "k_bmm_quantizer" if leaf == "k_scale" else "v_bmm_quantizer"
        setattr(model.get_submodule(attention), quantizer, Fp8Round(tensors.pop(name)))


def refresh_quantized(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Nvfp4Linear | Fp8Linear):
            module.refresh()
