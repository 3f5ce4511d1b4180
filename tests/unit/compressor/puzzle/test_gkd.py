"""GKD's resumable checkpoints: a run killed after a checkpoint resumes and trains the child an uninterrupted run
trains; a checkpoint of another run is not used."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tailor.compressor.checkpoint import load_decoder, read_config, write_checkpoint
from tailor.compressor.lazy import LazyDecoder
from tailor.compressor.puzzle import gkd, parallel
from tailor.compressor.puzzle.plan import Training
from tailor.compressor.puzzle.resume import Checkpoints


class Killed(Exception):
    """Stands for the job being killed right after a checkpoint was saved."""


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    parallel.init(torch.device("cpu"))
    yield
    parallel.finish()


@pytest.fixture
def assembled(tiny_parent: Path, tmp_path: Path) -> Path:
    """The parent with its weights perturbed: a child GKD has something to teach."""
    model = load_decoder(tiny_parent)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    write_checkpoint(model, tmp_path / "assembled", read_config(tiny_parent), tiny_parent)
    return tmp_path / "assembled"


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for file in sorted(folder.glob("*.safetensors")) for name, tensor in load_file(file).items()}


@pytest.mark.parametrize("budget_bytes", [None, 3e5], ids=["sharded-teacher", "streamed-teacher"])
def test_a_killed_gkd_resumes_from_its_checkpoint(tiny_parent: Path, assembled: Path, tmp_path: Path,
                                                  budget_bytes: float | None) -> None:
    parent = LazyDecoder(tiny_parent)
    train = torch.randint(0, parent.arch.vocab_size, (12, 32), generator=torch.Generator().manual_seed(0))
    budget = Training(tokens=6 * 2 * 32, lr=1e-3, batch=2)  # 6 steps
    lines: list[str] = []

    def run(out: Path, every: float, progress: object = lines.append) -> list[float]:
        return gkd.distill(assembled, out, parent, tiny_parent, train, budget, 7, progress,  # type: ignore[arg-type]
                           budget_bytes, every)

    whole = run(tmp_path / "whole" / "child", 1e9)

    def killed_after_step_3(line: str) -> None:
        lines.append(line)
        if line.startswith("gkd: checkpoint after step 3/"):
            raise Killed

    out = tmp_path / "resumed" / "child"
    with pytest.raises(Killed):
        run(out, 0, killed_after_step_3)
    checkpoint = out.with_name(gkd.CHECKPOINT_FOLDER)
    assert (checkpoint / "progress.json").exists() and not out.exists()
    assert not list(out.parent.glob("*.partial"))
    # killed between a save's two renames: the previous checkpoint, set aside, is the one to resume from
    checkpoint.rename(checkpoint.with_name(checkpoint.name + ".previous"))
    resumed = run(out, 1e9)
    assert any(line.startswith("gkd: resumed after step 3/6") for line in lines)
    Checkpoints.clear(checkpoint)  # what the pipeline does once the round is recorded
    assert not list(out.parent.glob(f"{gkd.CHECKPOINT_FOLDER}*"))
    assert len(resumed) == len(whole) == 6
    first, second = weights(tmp_path / "whole" / "child"), weights(out)
    if budget_bytes is None:  # the same computation: the same child, to the bit
        assert resumed == whole
        assert all(torch.equal(first[name], second[name]) for name in first)
    else:  # the teacher's states are recomputed over other row groupings: the same child up to rounding
        assert resumed == pytest.approx(whole, rel=1e-4)
        assert all(torch.allclose(first[name].float(), second[name].float(), atol=1e-2) for name in first)
    changed = [name for name in first if not torch.equal(first[name], weights(assembled)[name])]
    assert changed  # GKD trained something


def test_a_checkpoint_of_another_run_is_not_used(tiny_parent: Path, assembled: Path, tmp_path: Path) -> None:
    parent = LazyDecoder(tiny_parent)
    train = torch.randint(0, parent.arch.vocab_size, (12, 32), generator=torch.Generator().manual_seed(0))
    budget = Training(tokens=4 * 2 * 32, lr=1e-3, batch=2)
    out = tmp_path / "child"
    lines: list[str] = []

    def killed(line: str) -> None:
        if line.startswith("gkd: checkpoint after step 2/"):
            raise Killed

    with pytest.raises(Killed):
        gkd.distill(assembled, out, parent, tiny_parent, train, budget, 7, killed, None, 0)
    gkd.distill(assembled, out, parent, tiny_parent, train, budget, 8, lines.append, None, 1e9)  # another seed
    assert any("is of another run (changed: seed); starting over" in line for line in lines)
    assert not any("resumed" in line for line in lines)
