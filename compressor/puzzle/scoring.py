"""Stage 3, replace-1-block scoring: each variant alone in the otherwise unchanged current model.

The score is KL(current || with the variant) of next-token distributions, per token, on held-out
text; the LM loss is recorded too. The residual stream entering every slot and the reference
log-probabilities are computed once, so a variant costs the slots after it plus the LM head.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from pydantic import BaseModel

from tailor.compressor.modeling import Branch, Decoder, residual
from tailor.compressor.puzzle.bld import Progress, capture_inputs
from tailor.compressor.puzzle.library import Variant


class Score(BaseModel):
    kl: float  # nats per token, KL(reference || variant)
    lm_loss: float  # nats per token on the held-out text


def kl_and_loss(reference_logprobs: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, float]:
    """Mean KL(reference || model) and LM loss over next-token predictions (positions 0..n-2)."""
    logprobs = F.log_softmax(logits[:, :-1].float(), -1)
    reference = reference_logprobs[:, :-1].float()
    kl = (reference.exp() * (reference - logprobs)).sum(-1).mean()
    loss = F.nll_loss(logprobs.reshape(-1, logprobs.shape[-1]), ids[:, 1:].reshape(-1))
    return float(kl), float(loss)


@torch.no_grad()
def score_variants(model: Decoder, variants: list[list[Variant]], branches: dict[tuple[int, str], Branch],
                   ids: torch.Tensor, known: dict[str, Score], progress: Progress,
                   batch: int = 8) -> dict[str, Score]:
    """Scores keyed "slot:label"; entries already in `known` are kept, not recomputed."""
    inputs = capture_inputs(model, ids, batch)
    reference = torch.cat([F.log_softmax(model.head(model.run_slots(inputs[0][i:i + batch])).float(), -1)
                           for i in range(0, ids.shape[0], batch)])
    scores = dict(known)
    todo = [v for options in variants for v in options if f"{v.slot}:{v.label}" not in scores]
    started = time.monotonic()
    for done, variant in enumerate(todo, 1):
        if variant.is_current:
            _, loss = kl_and_loss(reference, reference, ids)
            scores[f"{variant.slot}:{variant.label}"] = Score(kl=0.0, lm_loss=loss)
            continue
        branch = branches[(variant.slot, variant.label)]
        kls, losses = [], []
        for i in range(0, ids.shape[0], batch):
            x = residual(branch, inputs[variant.slot][i:i + batch])
            logits = model.head(model.run_slots(x, variant.slot + 1))
            kl, loss = kl_and_loss(reference[i:i + batch], logits, ids[i:i + batch])
            kls.append(kl)
            losses.append(loss)
        scores[f"{variant.slot}:{variant.label}"] = Score(kl=sum(kls) / len(kls), lm_loss=sum(losses) / len(losses))
        if done % 10 == 0 or done == len(todo):
            eta = (time.monotonic() - started) / done * (len(todo) - done)
            progress(f"scoring: {done}/{len(todo)} variants, eta {eta:.0f}s")
    return scores
