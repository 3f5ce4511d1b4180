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

from tailor.compressor.model.fp8 import Fp8Linear, Fp8Round
from tailor.compressor.model.modeling import SelfAttention
from tailor.compressor.model.moe import unstack_experts
from tailor.compressor.model.nvfp4 import Nvfp4Linear

# quant_algo of a modelopt export -> the format of its quantized layers
QUANT_ALGORITHMS = {"FP8": "fp8", "NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4"}


class QuantizedCheckpointError(ValueError):
    """A quantized export whose tensors and quantization config disagree; the message names the file."""


def swap_quantized_layers(model: nn.Module, tensors: dict[str, torch.Tensor], section: dict[str, Any],
                          source: Path, dtype: torch.dtype = torch.float32, prefix: str = "") -> dict[str, str]:
    """Replace each linear layer the export quantized by its `Nvfp4Linear` / `Fp8Linear`, computing in `dtype`
    (their scales stay float32); return the format of each replaced layer. `model` may be one part of the
    exported model (a layer), whose checkpoint names start with `prefix`; `tensors` are named relative to it.
    `section` is the export's `quantization` section, read from `source` (its hf_quant_config.json). Call
    `refresh_quantized` after loading the state dict. Stacked experts are unstacked first: the export quantized
    each expert's `nn.Linear`."""
    unstack_experts(model)
    expected = QUANT_ALGORITHMS[section["quant_algo"]]
    excluded = section.get("exclude_modules") or []
    formats: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        is_excluded = any(fnmatch.fnmatchcase(f"{prefix}{name}", pattern) for pattern in excluded)
        stored = tensors.get(f"{name}.weight")
        if f"{name}.weight_scale" not in tensors:
            if not is_excluded:
                raise QuantizedCheckpointError(f"{source}: {prefix}{name} is stored unquantized but not in "
                                               "exclude_modules")
            continue
        if is_excluded:
            raise QuantizedCheckpointError(f"{source}: {prefix}{name} is stored quantized but matches "
                                           "exclude_modules")
        if stored is not None and stored.dtype == torch.uint8:
            replacement: nn.Module = Nvfp4Linear(module.in_features, module.out_features,
                                                 quantize_inputs=f"{name}.input_scale" in tensors, dtype=dtype)
            kind = "nvfp4"
        else:
            replacement, kind = Fp8Linear(module.in_features, module.out_features, dtype), "fp8"
        if kind != expected:
            raise QuantizedCheckpointError(f"{source}: quant_algo is {section['quant_algo']} but {prefix}{name} "
                                           f"is stored as {kind}")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, replacement)
        formats[name] = kind
    _restore_kv_cache(model, tensors, section, source, prefix)
    return formats


def _restore_kv_cache(model: nn.Module, tensors: dict[str, torch.Tensor], section: dict[str, Any],
                      source: Path, prefix: str) -> None:
    """Round keys and values as an FP8 KV cache does where the export says so: every attention layer then has
    a `k_scale` and a `v_scale` (under `k_proj` / `v_proj`, not on a module of the modeling), which are taken
    out of `tensors`."""
    algo = section.get("kv_cache_quant_algo")
    if algo not in (None, "FP8"):
        raise QuantizedCheckpointError(f"{source}: field 'quantization.kv_cache_quant_algo' is {algo!r}; "
                                       "supported: FP8 or null")
    scales = {name for name in tensors if name.endswith((".k_proj.k_scale", ".v_proj.v_scale"))}
    for name, module in model.named_modules():
        if not isinstance(module, SelfAttention):
            continue
        wanted = {f"{name}.k_proj.k_scale", f"{name}.v_proj.v_scale"}
        if not (wanted <= scales if algo == "FP8" else not wanted & scales):
            raise QuantizedCheckpointError(f"{source}: kv_cache_quant_algo is {algo} but attention {prefix}{name} "
                                           f"has {len(wanted & scales)} of its 2 KV-cache scales")
        scales -= wanted
        if algo == "FP8":
            module.k_bmm_quantizer = Fp8Round(tensors.pop(f"{name}.k_proj.k_scale"))
            module.v_bmm_quantizer = Fp8Round(tensors.pop(f"{name}.v_proj.v_scale"))
    if scales:
        raise QuantizedCheckpointError(f"{source}: KV-cache scales of no attention layer: "
                                       f"{sorted(prefix + name for name in scales)[:4]}")


def refresh_quantized(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Nvfp4Linear | Fp8Linear):
            module.refresh()
