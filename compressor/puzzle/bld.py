"""Stage 2, blockwise local distillation (BLD): every variant learns to imitate its own slot.

Each variant sees the current model's residual stream entering its slot and is trained on the
normalised MSE between its branch output and the current branch's, ||o_child - o_parent||^2 /
||o_parent||^2. Attention and FFN slots are separate (decoupled BLD: (m + n) * L trainings instead of
m * n * L), so variants train independently: with torch.distributed (`torchrun`, gloo on CPU, nccl on
GPUs) the slots are shared out by their number of variants, and a rank holds only the slot it trains:
the current branch (read from the checkpoint), one chunk of its captured inputs and their targets
(`Captured`, read from the claim a chunk at a time) and one variant at a time, saved as soon as it is
trained. Each trained variant is saved on its own, so a killed job resumes where it stopped.
"""

from __future__ import annotations

import math
import time
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from tailor.compressor import peaks
from tailor.compressor.files import save_tensors
from tailor.compressor.model.checkpoint import CheckpointError
from tailor.compressor.model.device import autocast
from tailor.compressor.model.lazy import LazyDecoder, materialise
from tailor.compressor.model.modeling import Branch, HybridLayer, Layer, build_branch, residual
from tailor.compressor.puzzle import parallel
from tailor.compressor.puzzle.activations import Progress, chunk_files
from tailor.compressor.puzzle.activations import load as load_activations
from tailor.compressor.puzzle.library import Variant, init_variant
from tailor.compressor.puzzle.plan import Training

EVAL_ROWS = 8  # captured rows a no-grad pass (a variant's initialisation too) runs at once: a Mamba scan's
               # per-chunk states grow with them


def normalised_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-12)


def _modules(branch: Branch) -> nn.ModuleList:
    assert branch is not None
    return nn.ModuleList(branch)


def checkpoint_file(folder: Path, variant: Variant) -> Path:
    return folder / f"slot{variant.slot:03d}-{variant.label}.safetensors"


def save_branch(path: Path, branch: Branch, loss: float) -> None:
    """A trained variant in BF16, as the assembled child will hold it (half the claim float32 would take)."""
    state = {name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
             for name, tensor in _modules(branch).state_dict().items()}
    save_tensors(path, state, {"nmse": repr(loss)})


def _not_resumable(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(f"{path}: cannot resume from this BLD checkpoint ({str(error).splitlines()[0]}); "
                           "delete it to retrain the variant")


def load_branch(path: Path, fresh: Branch, device: torch.device, dtype: torch.dtype) -> Branch:
    """A saved variant in `fresh` (a branch built on the meta device)."""
    try:
        state = {name: tensor.to(device, dtype) for name, tensor in load_file(path).items()}
        materialise(_modules(fresh), state)
    except (SafetensorError, OSError, RuntimeError) as error:
        raise _not_resumable(path, error) from error
    return fresh


@torch.no_grad()
def _outputs(branch: Branch, inputs: torch.Tensor) -> torch.Tensor:
    """The branch's contribution to the residual stream on every captured row, EVAL_ROWS rows at a time."""
    return torch.cat([residual(branch, rows) - rows for rows in torch.split(inputs, EVAL_ROWS)])


class Captured:
    """A slot's captured training rows, read from the claim a chunk at a time, with the current branch's outputs
    on them (the targets). One chunk is resident: the last one read, kept until another is needed, so a slot of
    one chunk is read once for all its variants, and a pass over every chunk starts at the one held."""

    def __init__(self, files: list[Path], current: Branch, device: torch.device) -> None:
        self.files, self.current, self.device = files, current, device
        self.held: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.files)

    def chunk(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of chunk `index`."""
        if self.held is None or self.held[0] != index:
            self.held = None  # the old chunk goes before the next is read
            inputs = load_activations(self.files[index], self.device)
            self.held = (index, inputs, _outputs(self.current, inputs))
        return self.held[1], self.held[2]

    def order(self) -> list[int]:
        """Every chunk once, from the one held."""
        start = 0 if self.held is None else self.held[0]
        return [(start + i) % len(self) for i in range(len(self))]

    @torch.no_grad()
    def nmse(self, branch: Branch) -> float:
        """`normalised_mse` over every captured row, EVAL_ROWS rows at a time."""
        error = scale = 0.0
        count = 0
        for index in self.order():
            inputs, targets = self.chunk(index)
            for rows, wanted in zip(torch.split(inputs, EVAL_ROWS), torch.split(targets, EVAL_ROWS), strict=True):
                error += float((residual(branch, rows) - rows - wanted).pow(2).sum())
                scale += float(wanted.pow(2).sum())
            count += targets.numel()
        return error / max(scale, 1e-12 * count)


def distill(branch: Branch, captured: Captured, budget: Training, generator: torch.Generator,
            dtype: torch.dtype) -> tuple[float, float]:
    """Train `branch` in place on the captured rows (inputs -> targets) for budget.tokens tokens, computing in
    `dtype` (the captured streams'; `device.autocast`); its normalised MSE before and after. The steps go through
    the chunks in turn (an equal share each, from the one held), each step's rows drawn at random from its chunk.
    Gradients and the optimiser's state are freed before the final evaluation."""
    assert branch is not None
    initial = captured.nmse(branch)
    params = [p for module in branch for p in module.parameters()]
    optimiser = torch.optim.AdamW(params, lr=budget.lr, weight_decay=0.0)
    order = captured.order()
    seq_len = captured.chunk(order[0])[0].shape[1]
    steps = max(1, math.ceil(budget.tokens / (budget.batch * seq_len)))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s /
                                                                                                     steps)))
    precision = autocast(captured.device, dtype)
    for step in range(steps):
        inputs, targets = captured.chunk(order[step * len(order) // steps])
        rows = torch.randint(0, inputs.shape[0], (budget.batch,), generator=generator)
        with precision:
            loss = normalised_mse(residual(branch, inputs[rows]) - inputs[rows], targets[rows])
        optimiser.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimiser.step()
        schedule.step()
    optimiser.zero_grad(set_to_none=True)
    del optimiser, schedule, loss, inputs, targets
    return initial, captured.nmse(branch)


def trained(variant: Variant) -> bool:
    """Whether BLD trains `variant` (the current branch and removal need no training)."""
    return not variant.is_current and variant.label != "noop"


def owned_slots(variants: list[list[Variant]], rank: int, world: int) -> list[int]:
    """The slots with variants to train that rank `rank` trains, dealt by their number of trained variants."""
    counts = {options[0].slot: sum(map(trained, options)) for options in variants if any(map(trained, options))}
    return parallel.deal(counts, rank, world)


def run_bld(model: LazyDecoder, variants: list[list[Variant]], activations: Path, budget: Training,
            folder: Path, seed: int, progress: Progress) -> dict[str, float]:
    """Initialise and train every variant of this rank's slots (or resume it from `folder`); after the barrier,
    every rank returns the final normalised MSE of every trained variant."""
    folder.mkdir(parents=True, exist_ok=True)
    slots = model.slots()
    rank, world = parallel.rank_world()
    mine = [v for slot in owned_slots(variants, rank, world) for v in variants[slot] if trained(v)]
    todo = [v for v in mine if not checkpoint_file(folder, v).exists()]
    started, done = time.monotonic(), 0
    for slot_index in sorted({v.slot for v in todo}):
        slot = slots[slot_index]
        layer = model.layer(slot.layer)
        current = layer.branch(slot.kind)
        captured = Captured(chunk_files(activations, slot.index), current, model.device)
        for variant in (v for v in todo if v.slot == slot_index):
            branch = _initialised(variant, current, captured, model)
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{variant.slot}:{variant.label}".encode()))
            initial, loss = distill(branch, captured, budget, generator, model.dtype)
            if not loss <= initial:  # a variant training made worse (or NaN) is rebuilt as initialised
                branch, loss = _initialised(variant, current, captured, model), initial
            save_branch(checkpoint_file(folder, variant), branch, loss)
            del branch
            peaks.release_freed_memory()
            done += 1
            eta = (time.monotonic() - started) / done * (len(todo) - done)
            progress(f"bld: {done}/{len(todo)} slot {slot.index} ({slot.kind}, layer {slot.layer}) "
                     f"{variant.label}: nmse {loss:.4f}, eta {eta:.0f}s")
        del layer, current, captured
    parallel.barrier()
    return {f"{v.slot}:{v.label}": _saved_loss(checkpoint_file(folder, v))
            for options in variants for v in options if trained(v)}


def _initialised(variant: Variant, current: Branch, captured: Captured, model: LazyDecoder) -> Branch:
    """A new branch for `variant`, initialised on the first chunk's rows (`library.init_variant`)."""
    return init_variant(variant, current, captured.chunk(0)[0], model.settings, EVAL_ROWS)


def variant_branch(model: LazyDecoder, layer: Layer | HybridLayer, variant: Variant, folder: Path) -> Branch:
    """The branch `variant` puts in its slot: the current one (from `layer`), none, or the trained one."""
    slot = model.slots()[variant.slot]
    if variant.is_current:
        return layer.branch(slot.kind)
    if variant.label == "noop":
        return None
    with torch.device("meta"):
        fresh = build_branch(slot.kind, variant.part, model.arch.hidden_size, model.settings)
    return load_branch(checkpoint_file(folder, variant), fresh, model.device, model.dtype)


def _saved_loss(path: Path) -> float:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return float((handle.metadata() or {}).get("nmse", "nan"))
    except (SafetensorError, OSError) as error:
        raise _not_resumable(path, error) from error
