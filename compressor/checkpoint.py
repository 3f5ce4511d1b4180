"""Reading and writing checkpoints: Hugging Face folders (config.json, safetensors, tokenizer files).

Parents are plain `llama` folders; children are written in the public `nemotron-nas` (DeciLM)
convention: `model_type: nemotron-nas`, `architectures: [DeciLMForCausalLM]` and one `block_configs`
entry per layer (attention: `no_op`, `replace_with_linear`, `n_heads_in_group`; FFN: `no_op`,
`replace_with_linear`, `intermediate_size` and the equivalent `ffn_mult`). A folder is written under a
temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tailor.compressor.architecture import (
    Architecture,
    Attention,
    ConfigError,
    Linear,
    Mlp,
    NoOp,
    architecture_from_config,
)
from tailor.compressor.files import staged_folder
from tailor.compressor.modeling import Decoder, ModelSettings

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
SUPPORTED = "llama, mistral (dense parents) and nemotron-nas (their Puzzle children)"


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, unreadable or does not match its config."""


def read_config(folder: Path) -> dict[str, Any]:
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such model folder")
    if not config_file.is_file():
        raise CheckpointError(f"{folder}: no config.json in the model folder")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{config_file}: unreadable ({error})") from error
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object")
    return config


def settings_from_config(config: dict[str, Any], source: str) -> ModelSettings:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{source}: field 'rope_parameters.rope_type' is {rope_type!r}; the project's "
                              "modeling supports 'default' rotary embeddings")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    return ModelSettings(rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)), rope_theta=float(theta))


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights in the model folder")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{file}: unreadable safetensors file ({error})") from error
    return tensors


def load_decoder(folder: Path, dtype: torch.dtype = torch.float32) -> Decoder:
    """A parent or child folder as the project's `Decoder`; every tensor must match the config."""
    config = read_config(folder)
    source = str(folder / "config.json")
    if config.get("model_type") not in ("llama", "mistral", "nemotron-nas"):
        raise CheckpointError(f"{source}: field 'model_type' is {config.get('model_type')!r}; supported: "
                              f"{SUPPORTED}")
    try:
        arch = architecture_from_config(config, source)
    except ConfigError as error:
        raise CheckpointError(str(error)) from error
    decoder = Decoder(arch, settings_from_config(config, source))
    tensors = _weights(folder)
    if arch.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = {name: p.shape for name, p in decoder.state_dict().items() if name != "lm_head.weight"
                or not arch.tie_word_embeddings}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(n for n in set(expected) & set(tensors) if tuple(tensors[n].shape) != tuple(expected[n]))
    if missing or unexpected or wrong:
        details = [f"{label}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                   for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
                   if names]
        raise CheckpointError(f"{folder}: weights do not match config.json ({'; '.join(details)})")
    decoder.load_state_dict(tensors, strict=not arch.tie_word_embeddings)
    return decoder.to(dtype)


def block_configs(arch: Architecture) -> list[dict[str, Any]]:
    """DeciLM `block_configs` for a Llama-family architecture."""
    entries = []
    for index, block in enumerate(arch.blocks):
        mixer, ffn = block.mixer, block.ffn
        attention: dict[str, Any] = {"no_op": isinstance(mixer, NoOp), "replace_with_linear": isinstance(mixer, Linear),
                                     "n_heads_in_group": None}
        if isinstance(mixer, Attention):
            attention["n_heads_in_group"] = mixer.num_heads // mixer.num_kv_heads
        feed: dict[str, Any] = {"no_op": isinstance(ffn, NoOp), "replace_with_linear": isinstance(ffn, Linear),
                                "intermediate_size": None, "ffn_mult": None}
        if isinstance(ffn, Mlp):
            feed["intermediate_size"] = ffn.intermediate_size
            feed["ffn_mult"] = round(1.5 * ffn.intermediate_size / arch.hidden_size, 6)
        elif not isinstance(ffn, Linear | NoOp):
            raise CheckpointError(f"block {index}: a {type(ffn).__name__} FFN has no nemotron-nas form")
        entries.append({"attention": attention, "ffn": feed})
    return entries


def child_config(parent_config: dict[str, Any], arch: Architecture) -> dict[str, Any]:
    config = {key: value for key, value in parent_config.items() if key not in ("architectures", "model_type")}
    config.update(architectures=["DeciLMForCausalLM"], model_type="nemotron-nas", block_configs=block_configs(arch),
                  num_hidden_layers=len(arch.blocks))
    return config


def save_decoder(decoder: Decoder, folder: Path, parent: Path) -> None:
    """Write `decoder` as a nemotron-nas child of the `parent` folder (its config fields and tokenizer)."""
    config = child_config(read_config(parent), decoder.arch)
    state = {name: tensor.detach().to(torch.bfloat16).contiguous() for name, tensor in decoder.state_dict().items()
             if not (decoder.arch.tie_word_embeddings and name == "lm_head.weight")}
    with staged_folder(folder) as staging:
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (parent / name).exists():
                shutil.copy2(parent / name, staging / name)
