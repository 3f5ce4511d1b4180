"""Text to token sequences: a training split and two held-out splits (scoring, evaluation).

A source is a built-in corpus (`sources.TEXTS`), a folder of .txt and .jsonl files, or one such file. Each .txt
file is a document, and each line of a .jsonl file (one JSON object, its text in a field). The held-out text is
a source of its own when the corpus states one (e.g. another domain), else every `heldout_every`-th document of
the training source, whole, so no passage of a held-out document is ever trained on. Windows are drawn from
every document in turn. The held-out text feeds the replace-1-block scores first and the report's evaluation
after, on disjoint tokens, so the search is not graded on what it chose by; quantization and the quality gate
evaluate on it too (`corpus_texts`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tailor.compressor import sources
from tailor.compressor.puzzle.plan import Corpus, Plan

JSONL = ".jsonl"


class DataError(ValueError):
    """Text that is missing, malformed, empty or too short for the plan; the message names the path and the need."""


@dataclass(frozen=True)
class Splits:
    train: torch.Tensor  # [sequences, seq_len] token ids
    scoring: torch.Tensor
    evaluation: torch.Tensor

    def describe(self) -> dict[str, int]:
        return {name: int(getattr(self, name).numel()) for name in ("train", "scoring", "evaluation")}


def text_files(text: str, field: str = "data.text") -> list[Path]:
    """The files of a text source (`field` names it in errors): a built-in corpus (`sources.TEXTS`), a folder's
    .txt and .jsonl files, or one file (JSONL if it ends in .jsonl)."""
    if text in sources.TEXTS:
        return sorted(sources.fetch_text(text).glob("*.txt"))
    path = Path(text)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".txt", JSONL) and p.is_file())
        if not files:
            raise DataError(f"{field}: {path} holds no .txt or .jsonl files")
        return files
    if path.is_file():
        return [path]
    raise DataError(f"{field}: {path} is neither a built-in corpus ({', '.join(sources.TEXTS)}), a folder of .txt "
                    "and .jsonl files nor a file")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise DataError(f"{path}: cannot read the text ({error.strerror})") from error


def _jsonl(path: Path, text_field: str) -> list[str]:
    """The documents of a JSONL file: one JSON object per line (blank lines skipped), its text in `text_field`."""
    texts = []
    for number, line in enumerate(_read(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path} line {number}: not JSON ({error.msg}); expected one JSON object per "
                            "line") from error
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataError(f"{path} line {number}: expected a JSON object with a string field {text_field!r}")
        texts.append(text)
    return texts


def documents(files: list[Path], text_field: str = "text") -> list[str]:
    """Each .txt (or other non-JSONL) file as one document, each line of a .jsonl file as one."""
    return [text for path in files
            for text in (_jsonl(path, text_field) if path.suffix == JSONL else [_read(path)])]


def split_texts(files: list[Path], every: int, text_field: str = "text") -> tuple[list[str], list[str]]:
    """(train, held-out) documents: every `every`-th is held out. A single document is split by lines
    instead: its last 1/every is held out."""
    texts = documents(files, text_field)
    if len(texts) == 1:
        lines = texts[0].splitlines(keepends=True)
        cut = len(lines) - max(1, len(lines) // every)
        return ["".join(lines[:cut])], ["".join(lines[cut:])]
    return ([t for i, t in enumerate(texts) if i % every != every - 1],
            [t for i, t in enumerate(texts) if i % every == every - 1])


def corpus_texts(corpus: Corpus) -> tuple[list[str], list[str]]:
    """(train, held-out) texts: with a stated held-out source, all of each (sharing no file), else the training
    source split by `heldout_every`. The one rule compression, quantization and the quality gate follow."""
    files = text_files(corpus.text)
    if corpus.heldout is None:
        return split_texts(files, corpus.heldout_every, corpus.text_field)
    heldout = text_files(corpus.heldout, "data.heldout")
    shared = sorted({p.resolve() for p in files} & {p.resolve() for p in heldout})
    if shared:
        raise DataError(f"data.heldout: {shared[0]} is in data.text too; held-out text is never trained on")
    return documents(files, corpus.text_field), documents(heldout, corpus.text_field)


PIECE_CHARACTERS = 4096  # tokenized at a time: a long document is never tokenized past what is taken of it


def _pieces(text: str, tokenizer: object, size: int) -> Iterator[list[int]]:
    """A document's token ids, `size` at a time (the last piece shorter), tokenized a piece of text at a time,
    cut where whitespace begins so no word is split."""
    start, ids = 0, []
    while start < len(text):
        end = len(text) if len(text) - start <= PIECE_CHARACTERS else start + PIECE_CHARACTERS
        if end < len(text):
            space = max(text.rfind(" ", start, end), text.rfind("\n", start, end))
            end = space if space > start else end
        ids.extend(tokenizer(text[start:end])["input_ids"])  # type: ignore[operator]
        start = end
        while len(ids) >= size:
            yield ids[:size]
            ids = ids[size:]
    if ids:
        yield ids


def token_windows(texts: list[str], tokenizer: object, seq_len: int, limit: int) -> torch.Tensor:
    """`seq_len`-token windows, up to `limit` tokens, over the documents taken in turn: a window's worth of
    tokens from each document, then the next from each, so a budget smaller than the corpus still draws on every
    document, not only the first (short documents run together, as in one stream)."""
    streams = [_pieces(text, tokenizer, seq_len) for text in texts]
    ids: list[int] = []
    while streams and len(ids) < limit:
        alive = []
        for stream in streams:
            piece = next(stream, None)
            if piece is not None:
                ids.extend(piece)
                alive.append(stream)
            if len(ids) >= limit:
                break
        streams = alive
    usable = min(len(ids), limit) // seq_len * seq_len
    return torch.tensor(ids[:usable], dtype=torch.long).view(-1, seq_len)


def load_splits(plan: Plan, tokenizer: object) -> Splits:
    data = plan.data
    train_texts, heldout_texts = corpus_texts(data)
    seq = data.seq_len
    train_need = max(plan.bld.tokens, plan.gkd.tokens)
    heldout_need = plan.scoring_tokens + plan.eval_tokens
    train = token_windows(train_texts, tokenizer, seq, train_need)
    heldout = token_windows(heldout_texts, tokenizer, seq, heldout_need + seq)
    scoring_rows = -(-plan.scoring_tokens // seq)
    if train.numel() < seq * max(plan.bld.batch, plan.gkd.batch):
        raise DataError(f"data.text: {data.text} gives {train.numel()} training tokens; one training batch "
                        f"needs {seq * max(plan.bld.batch, plan.gkd.batch)} (bld/gkd batch x data.seqLen)")
    if heldout.shape[0] < scoring_rows + 1 or heldout.numel() < heldout_need:
        raise DataError(f"{data.heldout_source()} gives {heldout.numel()} held-out tokens; scoringTokens + "
                        f"evalTokens need {heldout_need}")
    return Splits(train=train, scoring=heldout[:scoring_rows], evaluation=heldout[scoring_rows:])
