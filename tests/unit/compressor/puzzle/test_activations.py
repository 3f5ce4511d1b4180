"""Capture and BLD a chunk at a time: the captured stream is the model's own, and BLD's figures over chunks are
those over every row at once."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from tailor.compressor.model.lazy import LazyDecoder
from tailor.compressor.model.modeling import residual
from tailor.compressor.puzzle import activations
from tailor.compressor.puzzle.bld import Captured, distill, normalised_mse
from tailor.compressor.puzzle.plan import Training

CPU = torch.device("cpu")


def captured(tiny_parent: Path, folder: Path) -> tuple[LazyDecoder, torch.Tensor, torch.Tensor]:
    model = LazyDecoder(tiny_parent)
    generator = torch.Generator().manual_seed(0)
    train = torch.randint(0, 49152, (10, 16), generator=generator, dtype=torch.int32)  # as memory-mapped
    scoring = torch.randint(0, 49152, (3, 16), generator=generator)
    activations.capture(model, train, 9, scoring, folder, 4, lambda _: None)
    return model, train, scoring


def test_a_capture_in_chunks_is_the_models_own_residual_stream(tiny_parent: Path, tmp_path: Path) -> None:
    model, train, scoring = captured(tiny_parent, tmp_path)
    whole = model.load()
    states: list[torch.Tensor] = []
    scored: list[torch.Tensor] = []
    with torch.no_grad():
        whole(train[:9].long(), states=states)
        whole(scoring, states=scored)
    for slot in model.slots():
        files = activations.chunk_files(tmp_path, slot.index)
        assert [activations.load(path, CPU).shape[0] for path in files] == [4, 4, 1]  # 9 rows, 4 at a time
        if slot.kind == "mixer" and slot.layer > 0:  # the stream entering a layer: the one after the last
            torch.testing.assert_close(torch.cat([activations.load(path, CPU) for path in files]),
                                       states[slot.layer - 1])
            torch.testing.assert_close(activations.load(activations.scoring_file(tmp_path, slot.index), CPU),
                                       scored[slot.layer - 1])
    torch.testing.assert_close(activations.load(tmp_path / activations.FINAL, CPU), scored[-1])


def test_bld_over_chunks_measures_every_row_and_trains_one_chunk_at_a_time(tiny_parent: Path,
                                                                           tmp_path: Path) -> None:
    model, _, _ = captured(tiny_parent, tmp_path)
    slot = model.slots()[3]  # layer 1's FFN
    current = model.layer(slot.layer).branch(slot.kind)
    data = Captured(activations.chunk_files(tmp_path, slot.index), current, CPU)
    branch = copy.deepcopy(current)
    with torch.no_grad():
        for param in branch[1].parameters():  # type: ignore[index]
            param.mul_(0.5)
    inputs = torch.cat([activations.load(path, CPU) for path in activations.chunk_files(tmp_path, slot.index)])
    with torch.no_grad():
        every_row = float(normalised_mse(residual(branch, inputs) - inputs, residual(current, inputs) - inputs))
    assert abs(data.nmse(branch) - every_row) < 1e-5 * every_row
    read: list[int] = []
    chunk = data.chunk

    def counted(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if data.held is None or data.held[0] != index:
            read.append(index)
        return chunk(index)

    data.chunk = counted  # type: ignore[method-assign]
    initial, final = distill(branch, data, Training(tokens=16 * 12, lr=1e-3, batch=2), torch.Generator(),
                             torch.float32)
    assert final < initial
    # chunk 2 held: the first nmse reads 0 and 1, the 6 steps (2 per chunk, from 1) read 2 and 0, the last nmse
    # (from 0) reads 1 and 2; never two chunks at once
    assert read == [0, 1, 2, 0, 1, 2]
