"""Tiny parents with SmolLM2's tokenizer (a random Llama; the trained toy NemotronH hybrid), and plans that run
the pipeline on them in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tailor.compressor import sources

TINY = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 2048,
        "rope_theta": 100000.0}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M folder (`tailor data fetch`)."""
    return sources.fetch_parent()


@pytest.fixture(scope="session")
def tiny_parent(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-parent")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_hybrid() -> Path:
    """The toy NemotronH trained on Shakespeare (`tailor data fetch`; about two minutes the first time)."""
    from tailor.compressor.tiny_hybrid import fetch_tiny_hybrid

    return fetch_tiny_hybrid()


def tiny_plan(parent: Path, **changes: Any) -> dict[str, Any]:
    plan: dict[str, Any] = {
        "parent": str(parent), "data": {"seqLen": 64},
        "target": {"gpu": "cpu", "throughput": 1.04, "context": 128, "costs": "roofline"},
        "bld": {"tokens": 1024, "lr": 0.001, "batch": 4}, "bldActivationTokens": 512,
        "scoringTokens": 256, "evalTokens": 256, "gkd": {"tokens": 512, "lr": 0.0001, "batch": 4},
        "measureTokens": 4,
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(plan.get(key), dict):
            plan[key] = {**plan[key], **value}
        else:
            plan[key] = value
    return plan


def write_plan(folder: Path, plan: dict[str, Any]) -> Path:
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path
