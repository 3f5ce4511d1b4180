"""The quality gate: a compressed (and quantized) child against its parent on held-out text.

Quality is top-1 next-token accuracy on the held-out text (the corpus's held-out source, or its held-out
documents, never trained on: the same rule as `tailor compress`); retention is the child's accuracy over the
parent's, compared with the floor the CompressedModel sets. Perplexities and KL(parent || child) are reported
beside it. Both models, quantized exports included, are streamed a layer at a time, never held whole. The result
is small JSON, so a Job can hand it to the operator as its termination message (at most 4096 bytes).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from tailor.compressor.model.lazy import LazyDecoder
from tailor.compressor.puzzle.data import corpus_texts
from tailor.compressor.puzzle.evaluate import logit_chunks
from tailor.compressor.puzzle.plan import Corpus
from tailor.compressor.puzzle.scoring import kl_and_loss
from tailor.compressor.results import GateResult
from tailor.compressor.text import token_windows


@torch.no_grad()
def _compare(child: LazyDecoder, parent: LazyDecoder, ids: torch.Tensor) -> dict[str, float]:
    """Both accuracies and LM losses, and KL(parent || child), a few sequences at a time (`logit_chunks`)."""
    totals = dict.fromkeys(("parent_hits", "child_hits", "parent_loss", "child_loss", "kl"), 0.0)
    for chunk, logits in logit_chunks({"parent": parent, "child": child}, ids):
        reference, child_logits = F.log_softmax(logits["parent"], -1), logits["child"]
        kl, child_loss = kl_and_loss(reference, child_logits, chunk)
        _, parent_loss = kl_and_loss(reference, reference, chunk)  # log-probabilities are their own log-softmax
        rows = chunk.shape[0]
        totals["kl"] += kl * rows
        totals["child_loss"] += child_loss * rows
        totals["parent_loss"] += parent_loss * rows
        totals["parent_hits"] += int((reference[:, :-1].argmax(-1) == chunk[:, 1:]).sum())
        totals["child_hits"] += int((child_logits[:, :-1].argmax(-1) == chunk[:, 1:]).sum())
    predictions, rows = ids.shape[0] * (ids.shape[1] - 1), ids.shape[0]
    return {"parent_score": totals["parent_hits"] / predictions, "child_score": totals["child_hits"] / predictions,
            "parent_perplexity": math.exp(totals["parent_loss"] / rows),
            "child_perplexity": math.exp(totals["child_loss"] / rows), "kl_to_parent": totals["kl"] / rows}


def evaluate(child: Path, parent: Path, min_retention: float, corpus: Corpus | None = None, seq_len: int = 256,
             eval_tokens: int = 4096) -> GateResult:
    """The gate on `corpus`'s held-out text (default: the built-in broad corpus' held-out documents)."""
    corpus = corpus or Corpus()
    if not 0 < min_retention <= 1:
        raise ValueError(f"--min-retention must be in (0, 1], got {min_retention}")
    _, held_out_texts = corpus_texts(corpus)
    ids = token_windows(held_out_texts, AutoTokenizer.from_pretrained(parent), seq_len, eval_tokens)
    if ids.numel() == 0:
        raise ValueError(f"{corpus.heldout_source()} gives no {seq_len}-token window")
    parent_model, child_model = LazyDecoder(parent, quantized_ok=True), LazyDecoder(child, quantized_ok=True)
    if child_model.arch.vocab_size != parent_model.arch.vocab_size:
        raise ValueError(f"{child}: vocabulary of {child_model.arch.vocab_size} tokens, the parent {parent} has "
                         f"{parent_model.arch.vocab_size}; the gate compares models sharing a tokenizer")
    figures = _compare(child_model, parent_model, ids)
    parent_score = figures["parent_score"]
    if parent_score == 0:
        raise ValueError(f"{parent}: the parent predicts none of the {ids.numel()} held-out tokens; there is no "
                         "quality to retain")
    retention = figures["child_score"] / parent_score
    return GateResult(retention=retention, min_retention=min_retention, passed=retention >= min_retention,
                      tokens=int(ids.numel()), **figures)
