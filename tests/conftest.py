"""Models shared by the test folders: the real SmolLM2-135M, a tiny random Llama with SmolLM2's tokenizer, and
the toy NemotronH hybrid trained on Shakespeare.

This file is loaded for every test, the operator's too, and the operator's tests run without the compressor
stack: torch and transformers are imported in the fixtures that need them, never at import time."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tailor.compressor import sources

TINY: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 2048,
    "rope_theta": 100000.0}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M folder (`tailor data fetch`)."""
    return sources.fetch_parent()


@pytest.fixture(scope="session")
def tiny_parent(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-parent")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, folder / name)
    return folder


MAX_TRAINING_LOSS = 5.5  # the toy hybrid's last training loss the tests rely on (random weights: ln 49152 = 10.8)


def trained(folder: Path) -> Path:
    """A toy hybrid trained on this machine, checked for the quality the tests rely on: a clear failure, not a
    verdict that depends on the machine, when its training fell short."""
    import json

    loss = json.loads((folder / "config.json").read_text()).get("training_loss")
    if not isinstance(loss, float) or loss > MAX_TRAINING_LOSS:
        pytest.fail(f"{folder}: the toy hybrid trained to loss {loss} on this machine; the tests rely on one at "
                    f"most {MAX_TRAINING_LOSS} (delete the folder to train it again)")
    return folder


@pytest.fixture(scope="session")
def tiny_hybrid() -> Path:
    """The toy NemotronH trained on Shakespeare (`tailor data fetch`, which `make test` runs first)."""
    from tailor.compressor.tiny_hybrid import fetch_tiny_hybrid

    return trained(fetch_tiny_hybrid())
