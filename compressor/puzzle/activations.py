"""Stage 2a: the residual stream entering every slot, captured once per round and kept on the claim.

Rank 0 carries the BLD rows and the scoring rows through the current model slot by slot, one layer resident
and one chunk of rows at a time: the stream entering slot s+1 is slot s's branch applied to the stream entering
slot s, read back from the claim. Each slot gets a folder (`slot007/`) of training chunks
(`train-00000.safetensors`, ..., `chunk_rows` sequences each) and its scoring rows (`scoring.safetensors`);
`final.safetensors` holds the scoring rows after the last slot (the reference the scores compare with). So
capture holds one layer and two chunks (in and out), never the whole activation set, and reads each layer once.
BLD and scoring read only the slots they own, a chunk at a time. Written once: a resumed round reuses them
(`final.safetensors` is written last and marks a complete capture).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tailor.compressor.files import save_tensors
from tailor.compressor.model.checkpoint import CheckpointError
from tailor.compressor.model.lazy import LazyDecoder, run_rows
from tailor.compressor.puzzle import parallel, tokens

Progress = Callable[[str], None]
FINAL = "final.safetensors"
STREAM = "stream"  # the one tensor of every file: [sequences, seq_len, hidden]


def slot_folder(folder: Path, slot: int) -> Path:
    return folder / f"slot{slot:03d}"


def chunk_files(folder: Path, slot: int) -> list[Path]:
    """A slot's training chunks, in order."""
    return sorted(slot_folder(folder, slot).glob("train-*.safetensors"))


def scoring_file(folder: Path, slot: int) -> Path:
    return slot_folder(folder, slot) / "scoring.safetensors"


def _chunk_file(folder: Path, slot: int, chunk: int) -> Path:
    return slot_folder(folder, slot) / f"train-{chunk:05d}.safetensors"


def _save(path: Path, stream: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors(path, {STREAM: stream})


def capture(model: LazyDecoder, train: torch.Tensor, rows: int, scoring: torch.Tensor, folder: Path,
            chunk_rows: int, progress: Progress) -> None:
    """Rank 0 writes every slot's inputs for the first `rows` windows of `train` (memory-mapped token ids) and
    for `scoring`, unless a complete capture is there; every rank waits for it."""
    if parallel.is_main() and not (folder / FINAL).exists():
        shutil.rmtree(folder, ignore_errors=True)  # what a stopped capture left
        chunks = math.ceil(rows / chunk_rows)
        embedding = model.embedding()
        with torch.no_grad():
            for chunk in range(chunks):
                ids = tokens.take(train, slice(chunk * chunk_rows, min(rows, (chunk + 1) * chunk_rows)), model.device)
                _save(_chunk_file(folder, 0, chunk), embedding(ids))
            _save(scoring_file(folder, 0), embedding(scoring))
        del embedding
        slots = model.slots()
        for layer_index in sorted({slot.layer for slot in slots}):
            layer = model.layer(layer_index)
            for slot in (s for s in slots if s.layer == layer_index):
                after = slot.index + 1
                if after < len(slots):  # the training rows after the last slot are not needed
                    for chunk, path in enumerate(chunk_files(folder, slot.index)):
                        _save(_chunk_file(folder, after, chunk), run_rows(layer, slot, load(path, model.device)))
                scored = run_rows(layer, slot, load(scoring_file(folder, slot.index), model.device))
                _save(scoring_file(folder, after) if after < len(slots) else folder / FINAL, scored)
                if slot.index % 10 == 0:
                    progress(f"capture: slot {slot.index + 1}/{len(slots)}, {chunks} chunk(s) of {chunk_rows} rows")
            del layer
    parallel.barrier()


def load(path: Path, device: torch.device) -> torch.Tensor:
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(STREAM).to(device)
            return tensor
    except (SafetensorError, OSError, KeyError) as error:
        raise CheckpointError(f"{path}: unreadable captured activations ({error}); delete the folder to "
                              "capture them again") from error
