"""The training loop of the toy hybrid's pretraining: AdamW, a linear warm-up then cosine decay, gradient clipping
at 1, and progress lines with an ETA at least every PROGRESS_SECONDS (`Reporter`, which GKD's loop shares)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

PROGRESS_SECONDS = 20.0  # a training loop reports at least this often, however slow its steps


class Reporter:
    """When a loop of `steps` steps reports: every `every` steps, at the last, and once PROGRESS_SECONDS have
    passed since the last report."""

    def __init__(self, steps: int, every: int) -> None:
        self.steps, self.every, self.last = steps, every, time.monotonic()

    def due(self, step: int) -> bool:
        now = time.monotonic()
        if step % self.every == 0 or step == self.steps or now - self.last >= PROGRESS_SECONDS:
            self.last = now
            return True
        return False


def train(model: nn.Module, loss_of: Callable[[torch.Tensor], torch.Tensor], sequences: torch.Tensor, *,
          steps: int, lr: float, batch: int, seed: int, warmup: int, progress: Callable[[str], None], label: str,
          weight_decay: float = 0.0, report_every: int = 5) -> list[float]:
    """Train `model` in place on `batch` random rows of `sequences` per step; the loss of every step."""
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    generator = torch.Generator().manual_seed(seed)
    model.train()
    losses: list[float] = []
    started, reporter = time.monotonic(), Reporter(steps, report_every)
    for step in range(1, steps + 1):
        rows = torch.randint(0, sequences.shape[0], (batch,), generator=generator)
        loss = loss_of(sequences[rows])
        optimiser.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
        losses.append(loss.item())
        if reporter.due(step):
            eta = (time.monotonic() - started) / step * (steps - step)
            progress(f"{label}: step {step}/{steps}, {step * batch * sequences.shape[1]} tokens, "
                     f"loss {losses[-1]:.4f}, eta {eta:.0f}s")
    model.eval()
    return losses
