"""GKD's resumable checkpoints: the sharded child and its AdamW states saved with torch.distributed.checkpoint.

Each rank writes its own shards (no rank gathers the model) into a staged folder, which rank 0 swaps in for the
previous checkpoint once every rank is done (the previous one set aside until the new one is in place): a killed
job leaves the last complete checkpoint, never a partial one. `progress.json` beside the shards says what the
checkpoint was saved for (`RunKey`: the assembled child, the batch schedule, the optimiser settings) and how far
it got. A checkpoint of another run is not used: GKD starts over and says why. torch.distributed.checkpoint could
reshard on load, but the batch schedule depends on the number of ranks, so another world size starts over too.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from tailor.compressor.files import write_json
from tailor.compressor.model.checkpoint import CheckpointError
from tailor.compressor.puzzle import parallel
from tailor.compressor.puzzle.activations import Progress

PROGRESS_FILE = "progress.json"


class RunKey(BaseModel):
    """What makes two GKD runs the same run: a checkpoint of one resumes only that one."""

    child: str  # sha256 of the assembled child's config.json
    steps: int
    rows_per_step: int
    world: int
    seed: int
    lr: float


class Saved(BaseModel):
    key: RunKey
    step: int  # steps done
    losses: list[float]
    schedule: dict[str, Any]  # the learning-rate schedule's state_dict


def child_digest(folder: Path) -> str:
    return hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()


class Checkpoints:
    """Saves `model` (FSDP2-sharded), `optimiser` and `schedule` into `folder` every `every_seconds` (as rank 0's
    clock says), and resumes them from it."""

    def __init__(self, folder: Path, key: RunKey, every_seconds: float, model: torch.nn.Module,
                 optimiser: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LRScheduler,
                 progress: Progress) -> None:
        self.folder, self.key, self.every = folder, key, every_seconds
        self.model, self.optimiser, self.schedule, self.progress = model, optimiser, schedule, progress
        self.last = time.monotonic()

    def _state(self) -> dict[str, Any]:
        model, optimiser = get_state_dict(self.model, self.optimiser)
        return {"model": model, "optimiser": optimiser}

    def resume(self) -> tuple[int, list[float]]:
        """(steps already done, their losses): (0, []) without a checkpoint of this run."""
        found = [folder for folder in (self.folder, _aside(self.folder)) if (folder / PROGRESS_FILE).exists()]
        if not found:
            return 0, []
        folder = found[0]  # the previous checkpoint, when a kill came between the two renames of a save
        path = folder / PROGRESS_FILE
        try:
            saved = Saved.model_validate_json(path.read_text())
        except ValueError as error:
            raise CheckpointError(f"{path}: unreadable GKD progress ({str(error).splitlines()[0]}); delete "
                                  f"{folder} to start GKD over") from error
        if saved.key != self.key:
            changed = sorted(k for k, v in saved.key.model_dump().items() if getattr(self.key, k) != v)
            self.progress(f"gkd: the checkpoint in {folder} is of another run (changed: {', '.join(changed)});"
                          " starting over")
            return 0, []
        state = self._state()
        try:
            load(state, checkpoint_id=str(folder))
        except Exception as error:  # DCP raises many kinds; the path and the way out are what matter
            raise CheckpointError(f"{folder}: cannot resume GKD from this checkpoint "
                                  f"({str(error).splitlines()[0]}); delete it to start GKD over") from error
        set_state_dict(self.model, self.optimiser, model_state_dict=state["model"],
                       optim_state_dict=state["optimiser"])
        self.schedule.load_state_dict(saved.schedule)
        self.progress(f"gkd: resumed after step {saved.step}/{self.key.steps} from {folder}")
        return saved.step, saved.losses

    def after_step(self, step: int, losses: list[float]) -> None:
        """Save when the interval has passed (every rank must call it: saving is collective)."""
        due = step < self.key.steps and time.monotonic() - self.last >= self.every
        if parallel.broadcast("save" if due else "") != "save":
            return
        staging = _staging(self.folder)
        if parallel.is_main():
            shutil.rmtree(staging, ignore_errors=True)
        parallel.barrier()
        save(self._state(), checkpoint_id=str(staging))

        def swap_in() -> None:
            write_json(staging / PROGRESS_FILE, Saved(key=self.key, step=step, losses=losses,
                                                      schedule=self.schedule.state_dict()).model_dump())
            aside = _aside(self.folder)  # the last checkpoint stays whole until the new one is in place
            shutil.rmtree(aside, ignore_errors=True)
            if self.folder.exists():
                self.folder.rename(aside)
            staging.rename(self.folder)
            shutil.rmtree(aside, ignore_errors=True)

        parallel.on_main(swap_in, f"the GKD checkpoint of step {step} ({self.folder})")
        self.last = time.monotonic()
        self.progress(f"gkd: checkpoint after step {step}/{self.key.steps} in {self.folder}")

    @staticmethod
    def clear(folder: Path) -> None:
        """The trained child is written and recorded: the checkpoint in `folder` (and any staged or set-aside
        copy) has served."""
        if parallel.is_main():
            for path in (folder, _aside(folder), _staging(folder)):
                shutil.rmtree(path, ignore_errors=True)


def _aside(folder: Path) -> Path:
    return folder.with_name(folder.name + ".previous")


def _staging(folder: Path) -> Path:
    return folder.with_name(folder.name + ".partial")
