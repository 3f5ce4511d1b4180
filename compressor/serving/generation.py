"""Text generation with the project's own modeling: what the Triton Python-backend model runs.

Requests whose prompts have the same length are decoded together, one batched forward per step with
the KV / Mamba caches; others follow in turn. Each row samples with its own parameters and generator
(temperature 0 is greedy), and stops at its token budget or at the end-of-sequence token.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer

from tailor.compressor.model.checkpoint import load_decoder

DEFAULT_MAX_TOKENS = 64
MIN_TEMPERATURE = 1e-2  # a smaller positive temperature samples as this one (as vLLM does): logits / 1e-40 overflow


class GenerationRequest(BaseModel):
    """One prompt and how to continue it; field limits are the server's input validation."""

    model_config = ConfigDict(extra="forbid")

    ids: list[int] = Field(min_length=1, description="Prompt token ids.")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, le=4096)
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0, description="0: no top-k cut.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    ignore_eos: bool = False


# (request index, token id, whether this is the request's last token)
Emit = Callable[[int, int, bool], None]


class Generator:
    """A loaded model and its tokenizer."""

    def __init__(self, folder: Path, context: int, dtype: torch.dtype) -> None:
        self.model = load_decoder(folder, dtype).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.context = context  # prompt + generated tokens a request may hold (what the sizing reserved)
        self.eos = self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def check(self, request: GenerationRequest) -> None:
        """Raise ValueError when the request cannot be served: ids outside the vocabulary, or a prompt plus
        token budget beyond the context length."""
        vocab = self.model.arch.vocab_size
        if min(request.ids) < 0 or max(request.ids) >= vocab:
            raise ValueError(f"input_ids must lie in [0, {vocab}), got values from {min(request.ids)} to "
                             f"{max(request.ids)}")
        if len(request.ids) + request.max_tokens > self.context:
            raise ValueError(f"the prompt has {len(request.ids)} tokens and max_tokens is {request.max_tokens}: "
                             f"together beyond the context length of {self.context}")

    @torch.inference_mode()
    def generate(self, requests: list[GenerationRequest], emit: Emit) -> None:
        """Generate for every request, calling `emit` for each token as it is chosen."""
        groups: dict[int, list[int]] = defaultdict(list)
        for index, request in enumerate(requests):
            groups[len(request.ids)].append(index)
        for indices in groups.values():
            self._decode([requests[i] for i in indices], indices, emit)

    def _decode(self, rows: list[GenerationRequest], indices: list[int], emit: Emit) -> None:
        steps = max(row.max_tokens for row in rows)
        generators = [torch.Generator().manual_seed(row.seed) if row.seed is not None else None for row in rows]
        prompt = torch.tensor([row.ids for row in rows])
        caches = self.model.new_caches(len(rows), prompt.shape[1] + steps)
        logits = self.model(prompt, caches)[:, -1].float()
        produced = [0] * len(rows)
        done = [False] * len(rows)
        for _ in range(steps):
            tokens = [_sample(logits[i], row, generators[i]) for i, row in enumerate(rows)]
            for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
                if done[i]:
                    continue
                produced[i] += 1
                done[i] = produced[i] == row.max_tokens or (token == self.eos and not row.ignore_eos)
                emit(indices[i], token, done[i])
            if all(done):
                return
            logits = self.model(torch.tensor(tokens)[:, None], caches)[:, -1].float()


def _sample(logits: torch.Tensor, request: GenerationRequest, generator: torch.Generator | None) -> int:
    if request.temperature == 0:
        return int(logits.argmax())
    scores = logits / max(request.temperature, MIN_TEMPERATURE)
    if request.top_k:
        cut = torch.topk(scores, min(request.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < cut, float("-inf"))
    probs = torch.softmax(scores, -1)
    if request.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        outside = ordered.cumsum(-1) - ordered >= request.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(0, order, ordered.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))
