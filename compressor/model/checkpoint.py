"""Reading and writing checkpoints: Hugging Face folders (config.json, safetensors, tokenizer files).

Parents are `llama`/`mistral` or `nemotron_h` folders. Children follow the public conventions:
- of a Llama parent, `nemotron-nas` (DeciLM): `architectures: [DeciLMForCausalLM]` and one
  `block_configs` entry per layer (attention: `no_op`, `replace_with_linear`, `n_heads_in_group`; FFN:
  `no_op`, `replace_with_linear`, `intermediate_size` and the equivalent `ffn_mult`), with the config class
  engines read it through (`configuration_decilm.py`, named in `auto_map`);
- of a NemotronH parent, `nemotron_h_puzzle`: `architectures: [NemotronHPuzzleForCausalLM]`, the
  parent's layer pattern, and one `block_configs` entry per block with its `block_type` and the
  model-wide fields it overrides (Mamba heads, head dim and state; KV heads; MLP width; experts, top-k,
  expert and shared-expert widths), or `no_op` / `replace_with_linear`, with its config class
  (`configuration_nemotron_h_puzzle.py`, named in `auto_map`).
No other `auto_map` is written: a parent's (config or tokenizer) is dropped, so no code from outside travels.
Quantized folders are modelopt exports (`hf_quant_config.json`, a `quantization_config` in config.json);
their quantized layers load as the project's NVFP4 / FP8 layers (`tailor.compressor.model.quantized`).
A folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tailor.compressor.files import staged_folder
from tailor.compressor.model.architecture import (
    CONFIG_CLASSES,
    Architecture,
    Attention,
    ConfigError,
    Linear,
    Mamba,
    Mlp,
    Moe,
    NoOp,
    Part,
    architecture_from_config,
    nemotron_h_block_types,
)
from tailor.compressor.model.modeling import Decoder, ModelSettings
from tailor.compressor.model.moe import Routing
from tailor.compressor.model.quantized import (
    QUANT_ALGORITHMS,
    QuantizedCheckpointError,
    refresh_quantized,
    swap_quantized_layers,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
LLAMA_TYPES = ("llama", "mistral", "nemotron-nas")
TOKENIZER_CONFIG = "tokenizer_config.json"
NEMOTRON_H_TYPES = ("nemotron_h", "nemotron_h_puzzle")
SUPPORTED = ("llama, mistral (dense parents), nemotron-nas (their Puzzle children), nemotron_h (hybrid parents) "
             "and nemotron_h_puzzle (their Puzzle children)")
# NemotronH options the modeling implements: field -> the one value it supports
NEMOTRON_H_FIXED = {"mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_bias": False, "mlp_bias": False,
                    "attention_bias": False, "use_conv_bias": True}


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, unreadable or does not match its config."""


QUANT_CONFIG = "hf_quant_config.json"  # a modelopt export's quantization config, beside config.json
# the float32 scales a modelopt export stores beside quantized weights
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")


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


def read_quant_config(folder: Path) -> dict[str, Any]:
    """The `hf_quant_config.json` of a modelopt export: what is quantized, and how."""
    path = folder / QUANT_CONFIG
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable ({error}); a modelopt export writes it") from error
    section = config.get("quantization") if isinstance(config, dict) else None
    if not isinstance(section, dict) or section.get("quant_algo") not in QUANT_ALGORITHMS:
        raise CheckpointError(f"{path}: field 'quantization.quant_algo' must be one of "
                              f"{', '.join(QUANT_ALGORITHMS)}")
    return config


def settings_from_config(config: dict[str, Any], source: str) -> ModelSettings:
    if config.get("model_type") in NEMOTRON_H_TYPES:
        for name, value in NEMOTRON_H_FIXED.items():
            if config.get(name, value) != value:
                raise CheckpointError(f"{source}: field {name!r} is {config[name]!r}; the project's NemotronH "
                                      f"modeling supports {value!r}")
        routing = Routing(scaling=float(config.get("routed_scaling_factor", 1.0)), groups=int(config.get("n_group", 1)),
                          top_groups=int(config.get("topk_group", 1)),
                          normalise=bool(config.get("norm_topk_prob", True)))
        return ModelSettings(family="nemotron_h", rms_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
                             rope_theta=None, time_step_min=float(config.get("time_step_min", 0.001)),
                             routing=routing)
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
    if config.get("model_type") not in LLAMA_TYPES + NEMOTRON_H_TYPES:
        raise CheckpointError(f"{source}: field 'model_type' is {config.get('model_type')!r}; supported: "
                              f"{SUPPORTED}")
    try:
        arch = architecture_from_config(config, source)
    except ConfigError as error:
        raise CheckpointError(str(error)) from error
    try:  # cast before any quantized layer goes in: their scales stay float32
        decoder = Decoder(arch, settings_from_config(config, source)).to(dtype)
    except ValueError as error:
        raise CheckpointError(f"{source}: {error}") from error
    tensors = _weights(folder)
    quantized = "quantization_config" in config
    if quantized:  # a modelopt export: its quantized layers become the project's NVFP4 / FP8 layers
        try:
            swap_quantized_layers(decoder, tensors, read_quant_config(folder)["quantization"],
                                  folder / QUANT_CONFIG, dtype)
        except QuantizedCheckpointError as error:
            raise CheckpointError(str(error)) from error
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
    if quantized:
        refresh_quantized(decoder)
    return decoder


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


def hybrid_block_configs(arch: Architecture) -> list[dict[str, Any]]:
    """`nemotron_h_puzzle` block_configs: each block's type and its own sizes."""
    return [_hybrid_entry(block.mixer if block.mixer is not None else block.ffn, index)
            for index, block in enumerate(arch.blocks)]


def _hybrid_entry(part: Part | None, index: int) -> dict[str, Any]:
    if isinstance(part, Mamba):
        return {"block_type": "mamba", "mamba_num_heads": part.num_heads, "mamba_head_dim": part.head_dim,
                "ssm_state_size": part.state_size, "n_groups": part.n_groups}
    if isinstance(part, Attention):
        return {"block_type": "attention", "num_attention_heads": part.num_heads,
                "num_key_value_heads": part.num_kv_heads, "head_dim": part.head_dim}
    if isinstance(part, Moe):
        return {"block_type": "moe", "n_routed_experts": part.num_experts, "num_experts_per_tok": part.top_k,
                "moe_intermediate_size": part.expert_width, "moe_shared_expert_intermediate_size": part.shared_width,
                "moe_latent_size": part.latent_size}
    if isinstance(part, Mlp):
        return {"block_type": "mlp", "intermediate_size": part.intermediate_size}
    if isinstance(part, Linear | NoOp):
        return {"block_type": None, "no_op": isinstance(part, NoOp), "replace_with_linear": isinstance(part, Linear)}
    raise CheckpointError(f"block {index}: a {type(part).__name__} has no nemotron_h_puzzle form")


def child_config(parent_config: dict[str, Any], arch: Architecture) -> dict[str, Any]:
    """The parent's config with the child's per-block structure, in its family's public convention."""
    config = {key: value for key, value in parent_config.items() if key not in ("architectures", "model_type")}
    if parent_config.get("model_type") in NEMOTRON_H_TYPES:
        entries = hybrid_block_configs(arch)
        for entry, kind in zip(entries, nemotron_h_block_types(parent_config), strict=True):
            if entry["block_type"] is None:
                entry["block_type"] = kind
        config.update(architectures=["NemotronHPuzzleForCausalLM"], model_type="nemotron_h_puzzle",
                      block_configs=entries)
        # engines read the Mamba shape from the model-wide fields only (vLLM): each one all blocks share goes there
        mambas = arch.mamba_layers()
        for field, sizes in (("mamba_num_heads", {m.num_heads for m in mambas}),
                             ("mamba_head_dim", {m.head_dim for m in mambas}),
                             ("ssm_state_size", {m.state_size for m in mambas}),
                             ("n_groups", {m.n_groups for m in mambas})):
            if len(sizes) == 1:
                config[field] = sizes.pop()
        return config
    config.update(architectures=["DeciLMForCausalLM"], model_type="nemotron-nas", block_configs=block_configs(arch),
                  num_hidden_layers=len(arch.blocks))
    return config


def write_checkpoint(decoder: Decoder, folder: Path, config: dict[str, Any], tokenizer_from: Path) -> None:
    """`decoder`'s weights in BF16, `config` and the tokenizer files of `tokenizer_from`, staged then renamed."""
    state = {name: tensor.detach().to(torch.bfloat16).contiguous() for name, tensor in decoder.state_dict().items()
             if not (decoder.arch.tie_word_embeddings and name == "lm_head.weight")}
    with staged_folder(folder) as staging:
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        write_metadata(staging, config, tokenizer_from)


HUB_REPOSITORY_PREFIX = "models--"  # a Hugging Face cache's folder of one repository: snapshots link to its blobs


def parent_file(folder: Path, name: str) -> Path | None:
    """The parent's file `name` in `folder` (None when it has none), kept to the parent's own files: a symbolic
    link may point only within `folder` (or, in a Hugging Face cache, its repository's folder, whose snapshots
    link to its blobs). One that leaves, say to /proc/self/environ from a tenant's claim, is refused, never
    copied into the child."""
    path = folder / name
    if not path.is_symlink():
        return path if path.exists() else None
    root = next((up for up in (folder, *folder.parents) if up.name.startswith(HUB_REPOSITORY_PREFIX)), folder)
    target = path.resolve()
    if not target.is_relative_to(root.resolve()) or not target.is_file():
        raise CheckpointError(f"{path}: a symbolic link to {target}, outside the parent's files ({root}): "
                              "copy the file into the folder itself")
    return path


def write_metadata(folder: Path, config: dict[str, Any], tokenizer_from: Path) -> None:
    """Beside a checkpoint's BF16 weights: its config.json (BF16 under both keys engines read, `dtype` and
    `torch_dtype`), the tokenizer files of `tokenizer_from`, and for a child the config class engines read it with.
    No `auto_map` of the parent's survives (in config.json or tokenizer_config.json): a loader with
    trust_remote_code would fetch and run the code it names; the only one left names tailor's config class."""
    config = {key: value for key, value in config.items() if key != "auto_map"}
    own = CONFIG_CLASSES.get(config.get("model_type", ""))
    if own is not None:
        config["auto_map"] = {"AutoConfig": own[1]}
        shutil.copy2(Path(__file__).with_name(own[0]), folder / own[0])
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"},
                                                   indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source := parent_file(tokenizer_from, name)) is not None:
            shutil.copy2(source, folder / name)
    if (folder / TOKENIZER_CONFIG).exists():
        try:
            tokenizer = json.loads((folder / TOKENIZER_CONFIG).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{tokenizer_from / TOKENIZER_CONFIG}: not JSON ({error})") from error
        if isinstance(tokenizer, dict) and tokenizer.pop("auto_map", None) is not None:
            (folder / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer, indent=2, ensure_ascii=False) + "\n")


def save_decoder(decoder: Decoder, folder: Path, parent: Path) -> None:
    """Write `decoder` as a Puzzle child of the `parent` folder (its config fields and tokenizer)."""
    write_checkpoint(decoder, folder, child_config(read_config(parent), decoder.arch), parent)
