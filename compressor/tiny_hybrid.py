"""A tiny NemotronH hybrid trained briefly on Shakespeare: the hybrid parent for tests and example plans.

No pretrained NemotronH weights can be fetched here, so this model has every part of the real family at
toy sizes: Mamba-2 with two groups, attention without rotary positions, a latent mixture of experts with
a shared expert and sigmoid routing with a score-correction bias, and a ReLU^2 MLP; its dense variant
(`DENSE_NAME`) has MLPs where the experts are, which vLLM's CPU build runs. It uses SmolLM2's
tokenizer and learns from the training works (the held-out ones stay unseen). Training is seeded, and the
result is cached like the fetched models (`~/.cache/tailor/models/tiny-nemotron-h`); it is a standard
`nemotron_h` folder that transformers' `NemotronHForCausalLM` loads.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tailor.compressor import sources
from tailor.compressor.model import training
from tailor.compressor.model.architecture import architecture_from_config
from tailor.compressor.model.checkpoint import settings_from_config, write_checkpoint
from tailor.compressor.model.mamba import Mamba2
from tailor.compressor.model.modeling import Decoder
from tailor.compressor.text import split_texts, text_files, token_windows

NAME = "tiny-nemotron-h"
DENSE_NAME = "tiny-nemotron-h-dense"
PATTERN, DENSE_PATTERN = "MEM*EME-", "M-M*-M--"
STEPS, BATCH, SEQ_LEN, LR, SEED = 300, 4, 128, 3e-3, 0


def config(vocab_size: int, bos: int | None, eos: int | None, dense: bool = False) -> dict[str, Any]:
    """A NemotronH config at toy sizes: 8 blocks, 3 Mamba-2, 3 MoE, 1 attention, 1 MLP (`dense`: 4 MLPs)."""
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "_name_or_path": DENSE_NAME if dense else NAME, "vocab_size": vocab_size, "hidden_size": 128,
        "hybrid_override_pattern": DENSE_PATTERN if dense else PATTERN,
        "tie_word_embeddings": False, "layer_norm_epsilon": 1e-5, "max_position_embeddings": 2048,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "attention_bias": False,
        "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4,
        "chunk_size": 64, "mamba_hidden_act": "silu", "use_conv_bias": True, "use_bias": False,
        "time_step_min": 0.001, "time_step_max": 0.1, "mamba_ssm_cache_dtype": "float32",
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "moe_shared_expert_intermediate_size": 128, "n_shared_experts": 1, "moe_latent_size": 64,
        "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "intermediate_size": 256, "mlp_hidden_act": "relu2", "mlp_bias": False,
    }


def build(model_config: dict[str, Any], seed: int = SEED) -> Decoder:
    """Freshly initialised: normal(0, 0.02) matrices, Mamba time steps spread log-uniformly over
    [time_step_min, time_step_max] as Mamba-2 initialises them."""
    torch.manual_seed(seed)
    decoder = Decoder(architecture_from_config(model_config, NAME), settings_from_config(model_config, NAME))
    low, high = model_config["time_step_min"], model_config["time_step_max"]
    with torch.no_grad():
        for weight in decoder.parameters():
            if weight.dim() == 2:
                weight.normal_(0.0, 0.02)
        for module in decoder.modules():
            if isinstance(module, Mamba2):
                dt = torch.exp(torch.rand(module.part.num_heads) * (math.log(high) - math.log(low)) + math.log(low))
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus
    return decoder


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def fetch_tiny_hybrid(dense: bool = False) -> Path:
    """The trained tiny hybrid's folder (`dense`: its MLP-only variant), trained (about two minutes on two cores)
    unless already there."""
    name = DENSE_NAME if dense else NAME
    final = sources.model_dir(name)
    if (final / "config.json").exists():
        return final
    from transformers import AutoTokenizer

    tokenizer_dir = sources.fetch_parent()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    train_texts, _ = split_texts(text_files(sources.TEXT_NAME), every=8)
    sequences = token_windows(train_texts, tokenizer, SEQ_LEN, STEPS * BATCH * SEQ_LEN)
    model_config = config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, dense)
    decoder = build(model_config)
    print(f"training {name} ({decoder.arch.total_params:,} parameters) on {sequences.numel():,} tokens",
          file=sys.stderr)
    def next_token_loss(ids: torch.Tensor) -> torch.Tensor:
        logits = decoder(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    losses = training.train(decoder, next_token_loss, sequences, steps=STEPS, lr=LR, batch=BATCH, seed=SEED,
                            warmup=20, progress=_progress, label=name, weight_decay=0.01, report_every=50)
    write_checkpoint(decoder, final, {**model_config, "training_loss": round(losses[-1], 4)}, tokenizer_dir)
    return final
