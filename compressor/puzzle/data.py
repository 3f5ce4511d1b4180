"""A plan's text as token sequences: a training split and two held-out splits (scoring, evaluation).

The held-out text is a source of its own when the corpus states one (e.g. another domain), else every
`heldout_every`-th document of the training source (`text.split_texts`). It feeds the replace-1-block scores
first and the report's evaluation after, on disjoint tokens, so the search is not graded on what it chose by;
quantization and the quality gate evaluate on it too (`corpus_texts`). Compression cuts its windows once into
files on the claim and memory-maps them (`load_splits`, `tokens`): no token budget is ever held in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tailor.compressor.puzzle import parallel, tokens
from tailor.compressor.puzzle.plan import Corpus, Plan
from tailor.compressor.text import DataError, Document, documents, split_texts, text_files, windows


@dataclass(frozen=True)
class Splits:
    train: torch.Tensor  # [sequences, seq_len] int32 token ids, memory-mapped: take rows with `tokens.take`
    scoring: torch.Tensor  # [sequences, seq_len] long, resident (held-out budgets are small)
    evaluation: torch.Tensor

    def describe(self) -> dict[str, int]:
        return {name: int(getattr(self, name).numel()) for name in ("train", "scoring", "evaluation")}


def corpus_texts(corpus: Corpus) -> tuple[list[Document], list[Document]]:
    """(train, held-out) documents: with a stated held-out source, all of each (sharing no file), else the
    training source split by `heldout_every`. The one rule compression, quantization and the quality gate
    follow."""
    files = text_files(corpus.text)
    if corpus.heldout is None:
        return split_texts(files, corpus.heldout_every, corpus.text_field)
    heldout = text_files(corpus.heldout, "data.heldout")
    shared = sorted({p.resolve() for p in files} & {p.resolve() for p in heldout})
    if shared:
        raise DataError(f"data.heldout: {shared[0]} is in data.text too; held-out text is never trained on")
    return documents(files, corpus.text_field), documents(heldout, corpus.text_field)


def load_splits(plan: Plan, tokenizer: object, folder: Path) -> Splits:
    """The plan's training and held-out windows: cut once into `folder` (rank 0 tokenizes as it writes; the
    others wait, and learn of a bad corpus from it), then memory-mapped. Windows already there for the same
    corpus and budgets are reused."""
    data = plan.data
    seq = data.seq_len
    train_need = max(plan.bld.tokens, plan.gkd.tokens)
    heldout_need = plan.scoring_tokens + plan.eval_tokens
    made_by = {"data": data.model_dump(mode="json"), "train_tokens": train_need, "heldout_tokens": heldout_need + seq}
    failure = ""
    if parallel.is_main() and tokens.made_by(folder) != made_by:
        try:
            train_texts, heldout_texts = corpus_texts(data)
            tokens.write(folder, {"train": windows(train_texts, tokenizer, seq, train_need),
                                  "heldout": windows(heldout_texts, tokenizer, seq, heldout_need + seq)}, seq, made_by)
        except DataError as error:
            failure = str(error)
    failure = parallel.broadcast(failure)
    if failure:
        raise DataError(failure)
    train, heldout = tokens.read(folder, "train"), tokens.read(folder, "heldout").long()
    scoring_rows = -(-plan.scoring_tokens // seq)
    if train.numel() < seq * max(plan.bld.batch, plan.gkd.batch):
        raise DataError(f"data.text: {data.text} gives {train.numel()} training tokens; one training batch "
                        f"needs {seq * max(plan.bld.batch, plan.gkd.batch)} (bld/gkd batch x data.seqLen)")
    if heldout.shape[0] < scoring_rows + 1 or heldout.numel() < heldout_need:
        raise DataError(f"{data.heldout_source()} gives {heldout.numel()} held-out tokens; scoringTokens + "
                        f"evalTokens need {heldout_need}")
    return Splits(train=train, scoring=heldout[:scoring_rows], evaluation=heldout[scoring_rows:])
