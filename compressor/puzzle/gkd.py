"""Stage 7, global knowledge distillation (GKD): the assembled child learns from the parent end to end.

Loss = sum over layers of (1 - cos(h_child, h_parent)) + KL(parent || child) on the logits (Puzzle:
adding the LM loss hurt). The budget is `gkd.tokens` training tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tailor.compressor import training
from tailor.compressor.modeling import Decoder
from tailor.compressor.puzzle.bld import Progress
from tailor.compressor.puzzle.plan import Training


def layer_states(model: Decoder, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The residual stream after every layer, and the logits."""
    x = model.embed(ids)
    states = []
    for layer in model.layers:
        x = layer(x)
        states.append(x)
    return states, model.head(x)


def gkd_loss(child: Decoder, parent: Decoder, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        parent_states, parent_logits = layer_states(parent, ids)
    child_states, child_logits = layer_states(child, ids)
    cosine = sum((1 - F.cosine_similarity(c.float(), p.float(), dim=-1)).mean()
                 for c, p in zip(child_states, parent_states, strict=True))
    kl = F.kl_div(F.log_softmax(child_logits.float(), -1), F.log_softmax(parent_logits.float(), -1),
                  log_target=True, reduction="batchmean") / ids.shape[1]
    return cosine + kl


def distill(child: Decoder, parent: Decoder, train: torch.Tensor, budget: Training, seed: int,
            progress: Progress) -> list[float]:
    """Train `child` in place; the loss of every step."""
    parent.eval()
    steps = max(1, math.ceil(budget.tokens / (budget.batch * train.shape[1])))
    return training.train(child, lambda ids: gkd_loss(child, parent, ids), train, steps=steps, lr=budget.lr,
                          batch=budget.batch, seed=seed, warmup=max(1, steps // 10), progress=progress, label="gkd",
                          bf16=True)
