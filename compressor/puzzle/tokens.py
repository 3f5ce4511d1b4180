"""Token windows on the claim: written once by rank 0 as they are cut, memory-mapped by every rank.

A split is one file of int32 token ids, window after window (`<split>.tokens`, [windows, seq_len]), beside
`tokens.json`, which says what made them (the corpus, the sequence length, the budgets) and how many windows
each file holds. A rank reads the windows it takes by offset: the pages of a memory-mapped file are read when
touched and dropped by the kernel under pressure, so no rank ever holds a token budget (a 4B-token budget
is 16 GB of ids) in its own memory. Written to a staging folder, then renamed: a folder is complete or absent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tailor.compressor.files import staged_folder

META = "tokens.json"
WRITE_WINDOWS = 4096  # windows gathered before a write: 64 MiB of ids at 4096 tokens
DTYPE = torch.int32  # every vocabulary in reach is under 2**31 (Nemotron-3's is 131,072: too many for 16 bits)


def _file(folder: Path, split: str) -> Path:
    return folder / f"{split}.tokens"


def _batches(rows: Iterable[list[int]]) -> Iterator[list[list[int]]]:
    batch: list[list[int]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == WRITE_WINDOWS:
            yield batch
            batch = []
    if batch:
        yield batch


def write(folder: Path, splits: dict[str, Iterable[list[int]]], seq_len: int, made_by: dict[str, Any]) -> None:
    """Each split's windows streamed into its file, WRITE_WINDOWS at a time; `made_by` is recorded to be matched
    by `read` (a change of corpus or budget writes them again)."""
    with staged_folder(folder) as staging:
        counts = {}
        for split, rows in splits.items():
            counts[split] = 0
            with _file(staging, split).open("wb") as handle:
                for batch in _batches(rows):
                    handle.write(np.asarray(batch, dtype=np.int32).reshape(-1, seq_len).tobytes())
                    counts[split] += len(batch)
        (staging / META).write_text(json.dumps({"made_by": made_by, "seq_len": seq_len, "windows": counts}) + "\n")


def made_by(folder: Path) -> dict[str, Any] | None:
    """What the windows in `folder` were made from, or None where there are none (or they are unreadable)."""
    try:
        found = json.loads((folder / META).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return found.get("made_by") if isinstance(found, dict) else None


def read(folder: Path, split: str) -> torch.Tensor:
    """A split's windows, [windows, seq_len] int32, memory-mapped: rows are read from the file as they are
    taken (`take`)."""
    meta = json.loads((folder / META).read_text())
    count, seq_len = meta["windows"][split], meta["seq_len"]
    if count == 0:
        return torch.empty((0, seq_len), dtype=DTYPE)
    mapped = torch.from_file(str(_file(folder, split)), shared=False, size=count * seq_len, dtype=DTYPE)
    return mapped.view(count, seq_len)


def take(tokens: torch.Tensor, rows: torch.Tensor | slice, device: torch.device) -> torch.Tensor:
    """The windows `rows` of `tokens`, as the long token ids a model takes, on `device`."""
    return tokens[rows].to(device, torch.long)
