"""Every kind of checkpoint Tailor writes for vLLM to serve, small and with random weights, written by Tailor's
own writers: a dense Puzzle child of a Llama (DeciLM, `nemotron-nas`), NemotronH Puzzle children with and without
MoE blocks (`nemotron_h_puzzle`), the FP8 and NVFP4 exports `tailor quantize` makes of each (modelopt, a layer at
a time), and FP8 exports with an FP8 KV cache (its calibrated scales). Each child has per-block variety (fewer KV
heads, narrower MLPs, no-op parts, fewer or narrower experts) within what `engines.vllm_cannot_load` allows."""

from __future__ import annotations

from pathlib import Path

import torch

from tailor.compressor.model.architecture import Attention, Block, Mamba, Mlp, Moe, NoOp, architecture_from_config
from tailor.compressor.model.checkpoint import load_decoder, save_decoder, settings_from_config, write_checkpoint
from tailor.compressor.model.lazy import LazyDecoder
from tailor.compressor.model.modeling import Decoder
from tailor.compressor.quantize.streamed import write_quantized
from tailor.compressor.sizing.engines import vllm_cannot_load
from tailor.compressor.sizing.hardware import Precision
from tailor.compressor.sizing.memory import KvDtype, recipe_for

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 256, "tie_word_embeddings": False, "rope_theta": 5000.0, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 512, "hidden_act": "silu", "torch_dtype": "bfloat16"}
NEMOTRON_H = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 256,
              "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4,
              "chunk_size": 8, "intermediate_size": 96, "n_routed_experts": 8, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48, "moe_latent_size": 32,
              "max_position_embeddings": 512, "time_step_min": 0.001, "time_step_max": 0.1,
              "torch_dtype": "bfloat16"}
PATTERNS = {"hybrid": "M*M-M*-", "hybrid-moe": "M*EM-E*"}
QUANTIZED = ((Precision.FP8, KvDtype.BF16), (Precision.NVFP4, KvDtype.BF16), (Precision.FP8, KvDtype.FP8))


def _parent(config: dict, folder: Path) -> Path:
    """A random parent in `folder`, as transformers writes one (config, safetensors, a tokenizer file)."""
    torch.manual_seed(0)
    model = Decoder(architecture_from_config(config), settings_from_config(config, "child_kinds"))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")):
                weight.uniform_(0.5, 1.5)
            elif weight.dim() > 1:
                weight.normal_(0.0, 0.2)
    tokenizer = folder.with_name(folder.name + "-tokenizer")
    tokenizer.mkdir(parents=True)
    (tokenizer / "tokenizer.json").write_text("{}")
    write_checkpoint(model, folder, config, tokenizer)
    return folder


def _child(parent: Decoder, blocks: list[Block]) -> Decoder:
    arch = parent.arch.model_copy(update={"blocks": blocks})
    assert vllm_cannot_load(arch) == [], vllm_cannot_load(arch)
    torch.manual_seed(1)
    return Decoder(arch, parent.settings)


def dense_child(parent: Decoder) -> Decoder:
    attention = parent.arch.blocks[0].mixer
    assert isinstance(attention, Attention)
    return _child(parent, [Block(mixer=attention.model_copy(update={"num_kv_heads": 1}),
                                 ffn=Mlp(intermediate_size=96, gated=True)),
                           Block(mixer=attention, ffn=NoOp()),
                           Block(mixer=NoOp(), ffn=Mlp(intermediate_size=64, gated=True)),
                           parent.arch.blocks[3]])


def hybrid_child(parent: Decoder) -> Decoder:
    """Every block kept (vLLM's NemotronH builds each one of the pattern), the Mamba blocks as the parent's."""
    blocks = []
    for block in parent.arch.blocks:
        part = block.mixer or block.ffn
        if isinstance(part, Attention):
            blocks.append(Block(mixer=part.model_copy(update={"num_kv_heads": 1})))
        elif isinstance(part, Mlp):
            blocks.append(Block(ffn=part.model_copy(update={"intermediate_size": 48})))
        elif isinstance(part, Moe):
            blocks.append(Block(ffn=part.model_copy(update={"num_experts": 6, "expert_width": 16})))
        else:
            assert isinstance(part, Mamba)
            blocks.append(block)
    return _child(parent, blocks)


def write_kinds(root: Path) -> dict[str, Path]:
    """Every kind under `root`, by name: dense, hybrid, hybrid-moe, and each one's `-fp8`, `-nvfp4` and
    `-fp8-kv8` exports."""
    kinds: dict[str, Path] = {}
    parents = {"dense": (LLAMA, dense_child)} | {name: ({**NEMOTRON_H, "hybrid_override_pattern": pattern},
                                                        hybrid_child) for name, pattern in PATTERNS.items()}
    for name, (config, make_child) in parents.items():
        parent = _parent(config, root / f"{name}-parent")
        save_decoder(make_child(load_decoder(parent)), root / name, parent)
        kinds[name] = root / name
        model = LazyDecoder(root / name)
        calibration = torch.randint(0, model.arch.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
        for precision, kv_cache in QUANTIZED:
            recipe = recipe_for(precision, model.arch)
            folder = root / f"{name}-{precision.value}{'-kv8' if kv_cache is KvDtype.FP8 else ''}"
            folder.mkdir()
            write_quantized(model, recipe, calibration, kv_cache, folder, lambda line: None)
            kinds[folder.name] = folder
    return kinds
