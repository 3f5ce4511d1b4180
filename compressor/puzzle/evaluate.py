"""Quality and speed of a model against its parent, with one harness for every model compared.

- quality: perplexity and KL(parent || model) of next-token distributions on held-out sequences;
- speed: greedy decoding with the KV cache, `batch` requests after a `context`-token prompt, timed
  over `new_tokens` steps (median of `repeats` runs) in the run's compute dtype, the one the costs are measured in.
"""

from __future__ import annotations

import copy
import math
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel

from tailor.compressor.model.chunks import LAYER_TOKENS
from tailor.compressor.model.lazy import LazyDecoder, sweep
from tailor.compressor.model.modeling import Decoder
from tailor.compressor.puzzle.footprint import CHUNK_TOKENS
from tailor.compressor.puzzle.scoring import kl_and_loss


class Quality(BaseModel):
    perplexity: float
    lm_loss: float
    kl: float  # vs the reference model, nats per token


def final_and_head(model: Decoder | LazyDecoder, ids: torch.Tensor) -> tuple[torch.Tensor, torch.nn.Module]:
    """The residual stream after the last slot on `ids` and the module that turns it into logits."""
    if isinstance(model, LazyDecoder):
        return sweep(model, model.embedding()(ids)), model.head()
    rows = max(1, LAYER_TOKENS // ids.shape[1])  # whole sequences, at least one
    final = torch.cat([model.run_slots(model.embed(ids[i:i + rows])) for i in range(0, ids.shape[0], rows)])
    return final, torch.nn.Sequential(model.final_norm, model.lm_head)


def logit_chunks(models: Mapping[str, Decoder | LazyDecoder],
                 ids: torch.Tensor) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """(ids, each model's logits) a few sequences at a time. Every model is streamed once, one model and one LM
    head resident at a time: the logits (float32, tokens x vocabulary x 4 bytes per model) wait in a temporary
    folder."""
    rows = max(1, CHUNK_TOKENS // ids.shape[1])
    with tempfile.TemporaryDirectory(prefix="tailor-logits-") as folder, torch.no_grad():
        for number, model in enumerate(models.values()):  # files by number: a name may hold any character
            final, head = final_and_head(model, ids)
            for i in range(0, ids.shape[0], rows):
                torch.save(head(final[i:i + rows]).float(), Path(folder) / f"{number}.{i}.pt")
            del final, head
        for i in range(0, ids.shape[0], rows):
            yield ids[i:i + rows], {name: torch.load(Path(folder) / f"{number}.{i}.pt")
                                    for number, name in enumerate(models)}


def qualities(models: Mapping[str, Decoder | LazyDecoder], pairs: list[tuple[str, str]],
              ids: torch.Tensor) -> dict[tuple[str, str], Quality]:
    """For each (model, reference) pair of names: the model's perplexity and its KL to the reference on `ids`,
    every model streamed once (`logit_chunks`)."""
    sums = {pair: [0.0, 0.0] for pair in pairs}  # KL, LM loss, times sequences
    for chunk, logits in logit_chunks(models, ids):
        for model, reference in pairs:
            kl, loss = kl_and_loss(F.log_softmax(logits[reference], -1), logits[model], chunk)
            sums[(model, reference)][0] += kl * chunk.shape[0]
            sums[(model, reference)][1] += loss * chunk.shape[0]
    n = ids.shape[0]
    return {pair: Quality(perplexity=math.exp(loss / n), lm_loss=loss / n, kl=kl / n)
            for pair, (kl, loss) in sums.items()}


def quality(model: Decoder | LazyDecoder, reference: Decoder | LazyDecoder, ids: torch.Tensor) -> Quality:
    """Perplexity of `model` and its KL to `reference` on `ids`."""
    return qualities({"model": model, "reference": reference}, [("model", "reference")], ids)[("model", "reference")]


@torch.inference_mode()  # as the block timings are taken: no autograd bookkeeping on the cache updates
def decode_tokens_per_second(model: Decoder, batch: int, context: int, new_tokens: int, dtype: torch.dtype,
                             repeats: int = 3, seed: int = 0) -> float:
    """Generated tokens per second over all `batch` requests in `dtype`, prompt processing excluded."""
    runner = copy.deepcopy(model).to(dtype).eval()
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.arch.vocab_size, (batch, context), generator=generator)
    device = runner.embedding.weight.device
    samples = []
    for _ in range(repeats):
        caches = runner.new_caches(batch, context + new_tokens)
        token = runner(prompt.to(device), caches)[:, -1:].argmax(-1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(new_tokens):
            token = runner(token, caches)[:, -1:].argmax(-1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(batch * new_tokens / (time.perf_counter() - started))
    return statistics.median(samples)
