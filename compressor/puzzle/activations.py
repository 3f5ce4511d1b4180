"""Stage 2a: the residual stream entering every slot, captured once per round and kept on disk.

Rank 0 streams the current model over the BLD rows and the scoring rows, one layer resident at a time,
and writes one file per slot (`slot007.safetensors`: `train` and `scoring`) plus `final.safetensors`
(the scoring rows after the last slot: the reference the scores compare with). BLD and scoring read only
the slots they own, so no rank holds the whole model or every slot's activations. Written once: a
resumed round reuses them (`final.safetensors` is written last and marks a complete capture).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tailor.compressor.checkpoint import CheckpointError
from tailor.compressor.files import save_tensors
from tailor.compressor.lazy import LazyDecoder, sweep
from tailor.compressor.modeling import Slot
from tailor.compressor.puzzle import parallel

Progress = Callable[[str], None]
FINAL = "final.safetensors"


def slot_file(folder: Path, slot: int) -> Path:
    return folder / f"slot{slot:03d}.safetensors"


def capture(model: LazyDecoder, train: torch.Tensor, scoring: torch.Tensor, folder: Path,
            progress: Progress) -> None:
    """Rank 0 writes every slot's inputs (unless a complete capture is there); every rank waits for it."""
    if parallel.is_main() and not (folder / FINAL).exists():
        folder.mkdir(parents=True, exist_ok=True)
        embedding = model.embedding()
        with torch.no_grad():
            stream = torch.cat([embedding(train), embedding(scoring)])
        del embedding
        rows = train.shape[0]

        def keep(slot: Slot, x: torch.Tensor) -> None:
            save_tensors(slot_file(folder, slot.index), {"train": x[:rows], "scoring": x[rows:]})
            if slot.index % 10 == 0:
                progress(f"capture: slot {slot.index + 1}/{len(model.slots())}")

        final = sweep(model, stream, keep)
        save_tensors(folder / FINAL, {"scoring": final[rows:]})
    parallel.barrier()


def load(path: Path, split: str, device: torch.device) -> torch.Tensor:
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(split).to(device)
            return tensor
    except (SafetensorError, OSError, KeyError) as error:
        raise CheckpointError(f"{path}: unreadable captured activations ({error}); delete the folder to "
                              "capture them again") from error
