"""Quantization one layer at a time, so no step holds more than one layer of the model (and the calibration
stream) on its device.

Max calibration takes per-tensor amaxes of weights and of each linear layer's inputs, and during calibration
modelopt's quantizers observe without quantizing, so a layer's inputs are the unquantized model's residual
stream. Streaming the calibration tokens through the model a layer at a time, and calibrating each layer on the
stream entering it, gives the scales whole-model calibration gives. modelopt's quantizers and HF exporter work on
models, not layers: each layer is wrapped in a one-layer `Decoder` whose embedding and head are a stand-in
(`STAND_IN_VOCAB` tokens) that is neither calibrated nor written. The export is sharded, one file per layer, and
its `exclude_modules` is the union of the layers' entries (each layer's own renamed to its index), then checked
against every tensor written (`repair_exclusions`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tailor.compressor.model.lazy import LazyDecoder, ShardedWriter, recompute_rotary
from tailor.compressor.model.modeling import Decoder
from tailor.compressor.quantize.ptq import (
    calibrate,
    export,
    quantizable_layers,
    repair_exclusions,
    write_quant_config,
)
from tailor.compressor.quantize.recipes import tensor_group
from tailor.compressor.sizing.memory import KvDtype, QuantRecipe

STAND_IN_VOCAB = 16  # the wrapper's embedding and head: modelopt's exporter runs a 2-token dummy forward
ROWS = 8  # sequences per forward call
SKIP_WEIGHT_CHECK = "MODELOPT_SKIP_WEIGHT_QUANT_CHECK"  # modelopt 0.47's switch for a stage with no quantized weight


@dataclass
class StreamedExport:
    """What the layers' exports add up to: the quantized layers, the merged hf_quant_config and its repairs."""

    quantized_layers: list[str] = field(default_factory=list)
    quant_config: dict[str, Any] = field(default_factory=dict)
    repairs: list[str] = field(default_factory=list)


def one_layer_model(model: LazyDecoder, index: int) -> Decoder:
    """Layer `index` of `model` (its weights read now) inside a one-layer `Decoder` with a stand-in embedding
    and head, as modelopt's quantizers and exporter expect a model."""
    arch = model.arch.model_copy(update={"blocks": [model.arch.blocks[index]], "vocab_size": STAND_IN_VOCAB,
                                         "tie_word_embeddings": False})
    with torch.device("meta"):
        wrapper = Decoder(arch, model.settings)
    wrapper.layers[0] = torch.nn.Identity()  # so that allocating the stand-ins allocates no layer
    wrapper.to_empty(device=model.device)
    with torch.no_grad():
        for weight in (wrapper.embedding.weight, wrapper.lm_head.weight):
            weight.normal_(generator=torch.Generator(model.device).manual_seed(0))
        wrapper.final_norm.weight.fill_(1.0)
    wrapper.layers[0] = model.layer(index)
    recompute_rotary(wrapper, model.device)
    return wrapper.eval()


def _renamed(progress: Callable[[str], None], own: str, renamed: str, line: str) -> None:
    """A line about the one-layer wrapper, naming the layer as the model names it."""
    progress(line.replace(own, renamed, 1))


@contextmanager
def _allow_no_quantized_weights(allow: bool) -> Iterator[None]:
    """modelopt refuses a model in which its preset quantizes no weight, as it would a pipeline stage that has
    none of the targeted layers: a layer the recipe leaves whole (attention under the Mamba-MoE recipes) is
    such a model, and is still calibrated (its FP8 KV cache) and exported through modelopt."""
    if not allow:
        yield
        return
    before = os.environ.get(SKIP_WEIGHT_CHECK)
    os.environ[SKIP_WEIGHT_CHECK] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[SKIP_WEIGHT_CHECK]
        else:
            os.environ[SKIP_WEIGHT_CHECK] = before


def _merge_section(merged: dict[str, Any], section: dict[str, Any], index: int) -> None:
    """Fold one layer's `quantization` section (but its `exclude_modules`) into the model's: every field must
    agree across the layers that set it."""
    for key, value in section.items():
        if key == "exclude_modules" or value is None:
            continue
        if merged.setdefault(key, value) != value:
            raise ValueError(f"layer {index}: modelopt exported quantization.{key} = {value!r}, earlier layers "
                             f"{merged[key]!r}; one checkpoint holds one quantization config")


def quantize_layers(model: LazyDecoder, recipe: QuantRecipe, calibration: torch.Tensor, kv_cache: KvDtype,
                    writer: ShardedWriter, progress: Callable[[str], None]) -> StreamedExport:
    """Calibrate and export every layer of `model` on the `calibration` token ids, writing one shard per layer
    and one for the embedding, final norm and head (left unquantized: no recipe quantizes them)."""
    body = model.family_prefix
    done = StreamedExport()
    section: dict[str, Any] = {}
    excluded: list[str] = []
    stored: list[str] = []
    embedding = model.embedding()
    with torch.no_grad():
        streams = [embedding(calibration[i:i + ROWS]) for i in range(0, calibration.shape[0], ROWS)]
    del embedding
    count = len(model.arch.blocks)
    for index in range(count):
        wrapper = one_layer_model(model, index)
        outputs: list[torch.Tensor] = []

        @torch.no_grad()
        def forward_loop(module: Decoder, streams: list[torch.Tensor] = streams,
                         outputs: list[torch.Tensor] = outputs) -> None:
            # calibrating quantizers observe and pass their inputs through: the outputs are the unquantized
            # layer's, the next layer's input, so every layer runs once
            outputs[:] = [module.run_slots(stream) for stream in streams]

        own, renamed = f"{body}.layers.0.", f"{body}.layers.{index}."
        try:
            with _allow_no_quantized_weights(not any(tensor_group(name) in recipe.quantized for name in
                                                     quantizable_layers(wrapper) if name.startswith(own))):
                layers = calibrate(wrapper, recipe, forward_loop, kv_cache, partial(_renamed, progress, own, renamed))
        except ValueError as error:  # named in the one-layer wrapper's terms
            raise ValueError(str(error).replace(own, renamed)) from error
        if len(outputs) != len(streams):  # modelopt's max calibration runs the loop once
            raise RuntimeError(f"layer {index}: calibration ran the layer on {len(outputs)} of {len(streams)} "
                               f"streams")
        streams = outputs  # the next layer's input
        done.quantized_layers += [name.replace(own, renamed, 1) for name in layers]
        tensors, quant_config = export(wrapper, {**model.config, "vocab_size": STAND_IN_VOCAB,
                                                 "tie_word_embeddings": False})
        _merge_section(section, quant_config["quantization"], index)
        done.quant_config = {key: value for key, value in quant_config.items() if key != "quantization"}
        for entry in quant_config["quantization"].get("exclude_modules") or []:
            entry = entry.replace(own, renamed, 1) if isinstance(entry, str) else entry
            if entry not in excluded:  # the layer's own, and model-wide ones ("lm_head", patterns)
                excluded.append(entry)
        layer_tensors = {name.replace(own, renamed, 1): tensor for name, tensor in tensors.items()
                         if name.startswith(own)}
        writer.add(layer_tensors, as_stored=True)
        stored += layer_tensors
        del wrapper, tensors, layer_tensors
        progress(f"layer {index + 1}/{count}: {len(layers)} linear layers in {recipe.name}")
    ends = model.tensors(model.end_names(), dtype=torch.bfloat16)
    writer.add(ends)
    stored += ends
    done.quant_config["quantization"] = {**section, "exclude_modules": excluded}
    done.repairs = repair_exclusions(done.quant_config, stored, quantizable_layers(model.skeleton))
    return done


def write_quantized(model: LazyDecoder, recipe: QuantRecipe, calibration: torch.Tensor, kv_cache: KvDtype,
                    folder: Path, progress: Callable[[str], None]) -> StreamedExport:
    """The whole export in `folder` (staged by the caller): the shards, the index, hf_quant_config.json,
    config.json with its quantization_config, and the tokenizer of `model`'s folder."""
    writer = ShardedWriter(folder, len(model.arch.blocks) + 1)
    done = quantize_layers(model, recipe, calibration, kv_cache, writer, progress)
    writer.finish()
    write_quant_config(folder, done.quant_config, model.config, model.folder)
    return done
