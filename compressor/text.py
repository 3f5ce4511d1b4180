"""The text the jobs read: the documents of a source, the held-out split, and token windows drawn from them.

A source is a built-in corpus (`sources.TEXTS`), a folder of .txt and .jsonl files, or one such file. Each .txt
file is a document, and each line of a .jsonl file (one JSON object, its text in a field). Held out is every
`every`-th document, whole, so no passage of a held-out document is ever trained on. Windows are drawn from
every document in turn; a document is never read past what is taken of it.
"""

from __future__ import annotations

import codecs
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import torch

from tailor.compressor import sources

JSONL = ".jsonl"
PIECE_CHARACTERS = 4096  # read and tokenized at a time: a document is never read past what is taken of it
MAX_UNBROKEN = 16 * PIECE_CHARACTERS  # characters without whitespace tokenized as they are
MAX_RECORD_BYTES = 64 * 2**20  # a JSONL line (one document) is read whole: longer ones are refused, not loaded
SCAN_BYTES = 2**20  # read at a time when counting lines: a file's lines may be of any length


class DataError(ValueError):
    """Text that is missing, malformed, empty or too short for the plan; the message names the path and the need."""


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


@dataclass(frozen=True, slots=True)
class Document:
    """One document, read from its file only when its text is needed: bytes [start, end) of a text file (a
    whole .txt file, or a share of its lines), or one line of a JSONL file whose `field` holds the text (of
    which `lines`, when set, keeps a range of lines). No corpus is ever held in memory whole."""

    path: Path
    start: int = 0
    end: int | None = None  # None: to the end of the file
    field: str | None = None  # a JSONL record's text field
    lines: tuple[int, int | None] | None = None

    def chunks(self, size: int = PIECE_CHARACTERS) -> Iterator[str]:
        """The text, about `size` characters at a time, read as it is consumed."""
        if self.field is not None:
            text = _record_text(self.path, _read_bytes(self.path, self.start, self.end), self.field)
            if self.lines is not None:
                text = "".join(text.splitlines(keepends=True)[slice(*self.lines)])
            yield from (text[i:i + size] for i in range(0, len(text), size))
            return
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        position = self.start
        while self.end is None or position < self.end:
            block = _read_bytes(self.path, position, position + size if self.end is None else
                                min(position + size, self.end))
            if not block:
                break
            position += len(block)  # the file is open only while a block is read: thousands may be under way
            yield decoder.decode(block)
        yield decoder.decode(b"", final=True)

    def text(self) -> str:
        return "".join(self.chunks())


def _read_bytes(path: Path, start: int, end: int | None) -> bytes:
    try:
        with path.open("rb") as file:
            file.seek(start)
            return file.read(-1 if end is None else end - start)
    except OSError as error:
        raise DataError(f"{path}: cannot read the text ({error.strerror})") from error


def _record_text(path: Path, line: bytes, text_field: str, number: int | None = None) -> str:
    """The text of one JSONL line; errors name the file and (when known) the line."""
    where = f"{path} line {number}" if number is not None else str(path)
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{where}: not JSON ({getattr(error, 'msg', error)}); expected one JSON object per "
                        "line") from error
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(f"{where}: expected a JSON object with a string field {text_field!r}")
    return text


def _jsonl(path: Path, text_field: str) -> list[Document]:
    """The documents of a JSONL file: one JSON object per line (blank lines skipped), its text in `text_field`;
    every line is checked as the file streams past, none is kept."""
    found, offset = [], 0
    try:
        with path.open("rb") as file:
            for number, line in enumerate(iter(lambda: file.readline(MAX_RECORD_BYTES + 1), b""), start=1):
                if len(line) > MAX_RECORD_BYTES:
                    raise DataError(f"{path} line {number}: longer than {MAX_RECORD_BYTES // 2**20} MiB; a JSONL "
                                    "line is one document, read whole: split it into several")
                if line.strip():
                    _record_text(path, line, text_field, number)
                    found.append(Document(path, offset, offset + len(line), text_field))
                offset += len(line)
    except OSError as error:
        raise DataError(f"{path}: cannot read the text ({error.strerror})") from error
    return found


def documents(files: list[Path], text_field: str = "text") -> list[Document]:
    """Each .txt (or other non-JSONL) file as one document, each line of a .jsonl file as one."""
    return [document for path in files
            for document in (_jsonl(path, text_field) if path.suffix == JSONL else [Document(path)])]


def _last_lines(document: Document, every: int) -> tuple[Document, Document]:
    """A document split by lines: (all but its last 1/every of lines, those lines)."""
    if document.field is not None:
        count = len(document.text().splitlines())
        cut = count - max(1, count // every)
        return replace(document, lines=(0, cut)), replace(document, lines=(cut, None))
    try:
        with document.path.open("rb") as file:  # two passes, nothing kept: count the lines, then find the cut
            count = _line_start(file, None)
            offset = _line_start(file, count - max(1, count // every))
    except OSError as error:
        raise DataError(f"{document.path}: cannot read the text ({error.strerror})") from error
    return replace(document, end=offset), replace(document, start=offset)


def _line_start(file: BinaryIO, line: int | None) -> int:
    """Where line `line` (from 0) of `file` starts, in bytes; with None, how many lines it has (a last line
    without a newline counts). Read a block at a time: no line is ever held whole."""
    file.seek(0)
    seen, offset, last = 0, 0, b"\n"
    while block := file.read(SCAN_BYTES):
        count = block.count(b"\n")
        if line is not None and seen + count >= line:
            end = -1
            for _ in range(line - seen):
                end = block.index(b"\n", end + 1)
            return offset + end + 1
        seen, offset, last = seen + count, offset + len(block), block[-1:]
    return seen + (last != b"\n") if line is None else offset


def split_texts(files: list[Path], every: int, text_field: str = "text") -> tuple[list[Document], list[Document]]:
    """(train, held-out) documents: every `every`-th is held out. A single document is split by lines
    instead: its last 1/every is held out."""
    found = documents(files, text_field)
    if len(found) == 1:
        train, heldout = _last_lines(found[0], every)
        return [train], [heldout]
    return ([d for i, d in enumerate(found) if i % every != every - 1],
            [d for i, d in enumerate(found) if i % every == every - 1])


def _pieces(document: Document, tokenizer: object, size: int) -> Iterator[list[int]]:
    """A document's token ids, `size` at a time (the last piece shorter), tokenized as its text is read, cut
    where whitespace begins so that no word is split."""
    ids: list[int] = []
    rest = ""
    for chunk in itertools.chain(document.chunks(), [None]):  # None: the end, where the rest is tokenized too
        text = rest + (chunk or "")
        cut = len(text) if chunk is None else max(text.rfind(" "), text.rfind("\n"))
        if cut <= 0 and len(text) < MAX_UNBROKEN:
            rest = text
            continue
        cut = cut if cut > 0 else len(text)  # text without spaces (Chinese, say): cut where it is
        text, rest = text[:cut], text[cut:]
        ids.extend(tokenizer(text)["input_ids"])  # type: ignore[operator]
        while len(ids) >= size:
            yield ids[:size]
            ids = ids[size:]
    if ids:
        yield ids


def _visit_order(count: int, windows: int) -> Iterator[int]:
    """Document indices in order; with more documents than windows, spread over the whole corpus first (a
    golden-ratio stride), so a budget that reads only some of them still samples all of it."""
    if count <= windows:
        yield from range(count)
        return
    step = max(1, round(count * 0.6180339887))
    while math.gcd(step, count) != 1:
        step += 1
    yield from (i * step % count for i in range(count))


def windows(texts: list[Document], tokenizer: object, seq_len: int, limit: int) -> Iterator[list[int]]:
    """`seq_len`-token windows, up to `limit` tokens, as they are cut, over the documents taken in turn: a
    window's worth of tokens from each document, then the next from each, so a budget smaller than the corpus
    still draws on every document, not only the first (short documents run together, as in one stream). A
    document is opened when first reached and read only as far as it is taken (`_visit_order` says which come
    first); what is held at once is less than two windows and each open document's reading position."""
    wanted = limit // seq_len
    ids: list[int] = []
    given = 0

    def take(stream: Iterator[list[int]]) -> bool:
        piece = next(stream, None)
        ids.extend(piece or [])
        return piece is not None

    def ready() -> Iterator[list[int]]:
        nonlocal ids, given
        while len(ids) >= seq_len and given < wanted:
            window, ids = ids[:seq_len], ids[seq_len:]
            given += 1
            yield window

    alive = []
    for index in _visit_order(len(texts), max(1, wanted)):
        if given * seq_len + len(ids) >= limit:
            break
        stream = _pieces(texts[index], tokenizer, seq_len)
        if take(stream):
            alive.append(stream)
        yield from ready()
    while alive and given * seq_len + len(ids) < limit:
        still = []
        for stream in alive:
            if given * seq_len + len(ids) < limit and take(stream):
                still.append(stream)
            yield from ready()
        alive = still


def token_windows(texts: list[Document], tokenizer: object, seq_len: int, limit: int) -> torch.Tensor:
    """`windows` as one [sequences, seq_len] tensor: for budgets that are held whole anyway (evaluation,
    calibration); compression writes its training windows to disk instead (`tokens.write`)."""
    rows = list(windows(texts, tokenizer, seq_len, limit))
    return torch.tensor(rows, dtype=torch.long).view(len(rows), seq_len)
