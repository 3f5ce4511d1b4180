"""Post-training quantization with nvidia-modelopt and its Hugging Face export, on the project's `Decoder`.

`calibrate` inserts modelopt's quantizers from the recipe's preset, runs the calibration batches
(max calibration: per-tensor amax of weights and inputs), then leaves enabled exactly the layers the
recipe prices as quantized. `export` runs modelopt's unified HF exporter on the calibrated model: FP8
weights with per-tensor scales, or NVFP4 packed two values a byte with FP8 block scales, a float32
global scale and, for W4A4, the calibrated input scale. `repair_exclusions` checks an exporter's quantization
config against the tensors it wrote and repairs it where it is wrong. `tailor quantize` runs these a layer at a
time (`streamed`).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import modelopt.torch.quantization as mtq
import torch
from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
from modelopt.torch.export.unified_export_hf import _export_transformers_checkpoint
from modelopt.torch.quantization.nn import TensorQuantizer
from safetensors import safe_open
from transformers import PretrainedConfig

from tailor.compressor.files import write_json
from tailor.compressor.model.architecture import architecture_from_config
from tailor.compressor.model.checkpoint import (
    QUANT_CONFIG,
    SCALE_SUFFIXES,
    read_config,
    read_quant_config,
    settings_from_config,
    write_metadata,
)
from tailor.compressor.model.modeling import Decoder, SelfAttention
from tailor.compressor.model.moe import PROJECTIONS, ExpertList, Experts, MixtureOfExperts, unstack_experts
from tailor.compressor.quantize.recipes import tensor_group
from tailor.compressor.sizing.memory import KvDtype, QuantRecipe


def quantizable_layers(model: torch.nn.Module) -> list[str]:
    """Names of the linear layers (plain or carrying modelopt quantizers), stacked experts named one by one."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            names.append(name)
        elif isinstance(module, Experts):
            names += [f"{name}.{expert}.{projection}" for expert in range(len(module)) for projection in PROJECTIONS]
    return names


@torch.no_grad()
def calibrate(model: Decoder, recipe: QuantRecipe, forward_loop: Callable[[Decoder], object],
              kv_cache: KvDtype = KvDtype.BF16, progress: Callable[[str], None] = lambda _: None) -> list[str]:
    """Quantize `model` in place with the recipe's modelopt preset, calibrated by `forward_loop(model)` (which
    runs the calibration data through it); return the names of the quantized layers. Raises if the preset and
    the recipe disagree. With an FP8 `kv_cache`, every attention layer's keys and values get modelopt's FP8 KV
    quantizers too (`FP8_KV_CFG`). Experts no calibration token reached take their layer's largest input scale
    (`_share_expert_input_scales`). Experts are unstacked first, as modelopt quantizes `nn.Linear` modules."""
    if recipe.modelopt_config is None:
        raise ValueError(f"recipe {recipe.name} quantizes nothing")
    unstack_experts(model)
    preset = copy.deepcopy(getattr(mtq, recipe.modelopt_config))

    with contextlib.redirect_stdout(sys.stderr):  # modelopt prints; stdout carries the report
        mtq.quantize(model, preset)  # inserts the quantizers; calibration follows
        if kv_cache is KvDtype.FP8:
            for attention in model.modules():
                if isinstance(attention, SelfAttention):
                    attention.k_bmm_quantizer, attention.v_bmm_quantizer = TensorQuantizer(), TensorQuantizer()
            mtq.set_quantizer_by_cfg(model, copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]))
        mtq.calibrate(model, "max", forward_loop)
    _share_expert_input_scales(model, progress)
    quantized = []
    for name in quantizable_layers(model):
        module: Any = model.get_submodule(name)  # a modelopt QuantLinear
        if tensor_group(name) not in recipe.quantized:
            for quantizer in (module.weight_quantizer, module.input_quantizer):
                quantizer.disable()
        elif module.weight_quantizer.is_enabled:
            quantized.append(name)
        else:
            raise ValueError(f"{name}: recipe {recipe.name} quantizes {tensor_group(name).value} layers but "
                             f"{recipe.modelopt_config} left it unquantized")
    return quantized


def _share_expert_input_scales(model: Decoder, progress: Callable[[str], None]) -> None:
    """A routed expert that no calibration token was routed to has no input amax, and its export would lack the
    `input_scale` a W8A8 / W4A4 layer needs. It takes the largest amax of the same projection among its layer's
    experts, as modelopt does for the MoE layouts its exporter knows (serving engines take one input scale per
    layer's experts anyway)."""
    for name, moe in model.named_modules():
        if not isinstance(moe, MixtureOfExperts):
            continue
        assert isinstance(moe.experts, ExpertList)  # `calibrate` unstacked them
        for projection in PROJECTIONS:
            quantizers = [getattr(expert, projection).input_quantizer for expert in moe.experts]
            enabled = [q for q in quantizers if q.is_enabled]
            seen = [q.amax for q in enabled if q.amax is not None]
            missing = [index for index, q in enumerate(quantizers) if q.is_enabled and q.amax is None]
            if not missing:
                continue
            if not seen:
                raise ValueError(f"{name}: no calibration token reached any expert's {projection}")
            for index in missing:
                quantizers[index].amax = torch.stack(seen).amax(0)
            progress(f"{name}: experts {missing} got no calibration token; their {projection} input scale is the "
                     "largest of the layer's experts")


def export(model: Decoder, config: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """modelopt's HF export of a calibrated model: (tensors as they go to safetensors, hf_quant_config as the
    exporter wrote it; `repair_exclusions` checks it). Unquantized tensors are cast to BF16; scales stay
    float32. Consumes `model`."""
    # The exporter reads the HF config and device of the model it is given, as on a transformers model.
    model.__dict__.update(config=PretrainedConfig(**config), device=next(model.parameters()).device)
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
        # modelopt 0.47 wraps tensors in torch.tensor() (a UserWarning) and prints its progress
        warnings.simplefilter("ignore", UserWarning)
        state, quant_config = _export_transformers_checkpoint(model, torch.bfloat16)
    return {name: _stored(name, tensor) for name, tensor in state.items()}, quant_config


def _stored(name: str, tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach().cpu()
    if tensor.is_floating_point() and tensor.dtype == torch.float32 and not name.endswith(SCALE_SUFFIXES):
        tensor = tensor.to(torch.bfloat16)
    return tensor.contiguous()


def repair_exclusions(quant_config: dict[str, Any], stored: Iterable[str], linear_layers: list[str]) -> list[str]:
    """Make `quantization.exclude_modules` say exactly which linear layers the export left unquantized, given
    the stored tensor names. Returns what was changed.

    - modelopt 0.47 leaks a renaming sentinel into NemotronH exports ('lm_head.\\x00backbone.pt_name_sentinel'):
      such entries are cut back to the name before the sentinel, or dropped if nothing printable is left;
    - entries that would exclude a quantized layer are dropped;
    - unquantized linear layers no entry covers are added."""
    section = quant_config.setdefault("quantization", {})
    quantized = {name.removesuffix(".weight_scale") for name in stored if name.endswith(".weight_scale")}
    repairs: list[str] = []
    kept: list[str] = []
    for entry in section.get("exclude_modules") or []:
        cleaned = entry.split("\x00")[0].rstrip(".") if isinstance(entry, str) else ""
        if not cleaned or not cleaned.isprintable():
            repairs.append(f"dropped the malformed exclude_modules entry {entry!r}")
            continue
        if cleaned != entry:
            repairs.append(f"cut the exclude_modules entry {entry!r} back to {cleaned!r}")
        if any(fnmatch.fnmatchcase(name, cleaned) for name in quantized):
            repairs.append(f"dropped exclude_modules entry {cleaned!r}: it matches quantized layers")
        elif cleaned not in kept:
            kept.append(cleaned)
    for name in linear_layers:
        if name not in quantized and not any(fnmatch.fnmatchcase(name, entry) for entry in kept):
            kept.append(name)
            repairs.append(f"added {name!r} to exclude_modules: the export left it unquantized")
    section["exclude_modules"] = kept
    return repairs


def repair_export(folder: Path) -> list[str]:
    """Check a modelopt export folder (written by any tool) and rewrite its `hf_quant_config.json` and the
    `quantization_config` of its config.json when `exclude_modules` is wrong; return the repairs."""
    model_config = read_config(folder)
    quant_config = read_quant_config(folder)
    stored: list[str] = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            stored += list(handle.keys())
    with torch.device("meta"):  # the layer names only: no weights allocated
        model = Decoder(architecture_from_config(model_config, str(folder / "config.json")),
                        settings_from_config(model_config, str(folder / "config.json")))
    repairs = repair_exclusions(quant_config, stored, quantizable_layers(model))
    if repairs:
        write_json(folder / QUANT_CONFIG, quant_config)
    in_line = convert_hf_quant_config_format(quant_config)
    if model_config.get("quantization_config") != in_line:  # also after a run stopped between the two writes
        write_json(folder / "config.json", {**model_config, "quantization_config": in_line})
        repairs.append("rewrote config.json's quantization_config from hf_quant_config.json")
    return repairs


def write_quant_config(folder: Path, quant_config: dict[str, Any], model_config: dict[str, Any],
                       tokenizer_from: Path) -> None:
    """The files of a modelopt HF export beside its weights: hf_quant_config.json, config.json carrying the
    `quantization_config` that serving engines read (quant_method "modelopt"), and the tokenizer."""
    write_json(folder / QUANT_CONFIG, quant_config)
    write_metadata(folder, {**model_config, "quantization_config": convert_hf_quant_config_format(quant_config)},
                   tokenizer_from)
