"""Stage 2, blockwise local distillation (BLD): every variant learns to imitate its own slot.

Each variant sees the current model's residual stream entering its slot and is trained on the
normalised MSE between its branch output and the current branch's, ||o_child - o_parent||^2 /
||o_parent||^2. Attention and FFN slots are separate (decoupled BLD: (m + n) * L trainings instead of
m * n * L), so variants train independently: with torch.distributed (`torchrun`, gloo on CPU, nccl on
GPUs) rank r takes every world-th variant. Each trained variant is saved on its own, so a killed job
resumes where it stopped.
"""

from __future__ import annotations

import copy
import math
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from tailor.compressor.checkpoint import CheckpointError
from tailor.compressor.modeling import Branch, Decoder, build_branch, residual
from tailor.compressor.puzzle import parallel
from tailor.compressor.puzzle.library import Variant, init_variant
from tailor.compressor.puzzle.plan import Training

Progress = Callable[[str], None]


@torch.no_grad()
def capture_inputs(model: Decoder, sequences: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """The residual stream entering every slot, [sequences, seq_len, hidden] each."""
    per_slot: list[list[torch.Tensor]] = [[] for _ in model.slots()]
    for start in range(0, sequences.shape[0], batch):
        x = model.embed(sequences[start:start + batch])
        for slot in model.slots():
            per_slot[slot.index].append(x)
            x = model.layer(slot).run_branch(slot.kind, x)
    return [torch.cat(chunks) for chunks in per_slot]


def normalised_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-12)


def _modules(branch: Branch) -> nn.ModuleList:
    assert branch is not None
    return nn.ModuleList(branch)


def checkpoint_file(folder: Path, variant: Variant) -> Path:
    return folder / f"slot{variant.slot:03d}-{variant.label}.safetensors"


def save_branch(path: Path, branch: Branch, loss: float) -> None:
    partial = path.with_name(f".{path.name}.partial")
    state = {k: v.detach().contiguous() for k, v in _modules(branch).state_dict().items()}
    save_file(state, partial, metadata={"nmse": repr(loss)})
    partial.replace(path)


def load_branch(path: Path, fresh: Branch) -> Branch:
    try:
        state = load_file(path)
        _modules(fresh).load_state_dict(state)
    except (SafetensorError, OSError, RuntimeError) as error:
        raise CheckpointError(f"{path}: cannot resume from this BLD checkpoint ({str(error).splitlines()[0]}); "
                              "delete it to retrain the variant") from error
    return fresh


def distill(branch: Branch, inputs: torch.Tensor, targets: torch.Tensor, budget: Training,
            generator: torch.Generator) -> float:
    """Train `branch` in place on (inputs -> targets) for budget.tokens tokens; the final normalised MSE.
    Training never makes a variant worse than its initialisation: if it did, the initial weights stay."""
    assert branch is not None

    def evaluate() -> float:
        with torch.no_grad():
            return float(normalised_mse(residual(branch, inputs) - inputs, targets))

    initial, initial_state = evaluate(), copy.deepcopy(_modules(branch).state_dict())
    params = [p for module in branch for p in module.parameters()]
    optimiser = torch.optim.AdamW(params, lr=budget.lr, weight_decay=0.0)
    seq_len = inputs.shape[1]
    steps = max(1, math.ceil(budget.tokens / (budget.batch * seq_len)))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s /
                                                                                                     steps)))
    autocast = torch.autocast(inputs.device.type, dtype=torch.bfloat16)
    for _ in range(steps):
        rows = torch.randint(0, inputs.shape[0], (budget.batch,), generator=generator)
        with autocast:
            loss = normalised_mse(residual(branch, inputs[rows]) - inputs[rows], targets[rows])
        optimiser.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimiser.step()
        schedule.step()
    final = evaluate()
    if final > initial:
        _modules(branch).load_state_dict(initial_state)
        return initial
    return final


def run_bld(model: Decoder, variants: list[list[Variant]], sequences: torch.Tensor, budget: Training,
            folder: Path, seed: int, progress: Progress) -> tuple[dict[tuple[int, str], Branch], dict[str, float]]:
    """Initialise and train every variant (or resume it from `folder`); every rank returns all of them."""
    folder.mkdir(parents=True, exist_ok=True)
    inputs = capture_inputs(model, sequences, budget.batch)
    slots = model.slots()
    work = [v for options in variants for v in options if not v.is_current and v.label != "noop"]
    rank, world = parallel.rank_world()
    mine = work[rank::world]
    started = time.monotonic()
    losses: dict[str, float] = {}
    for done, variant in enumerate(mine, 1):
        path = checkpoint_file(folder, variant)
        if path.exists():
            continue
        slot = slots[variant.slot]
        current = model.layer(slot).branch(slot.kind)
        with torch.no_grad():
            targets = residual(current, inputs[slot.index]) - inputs[slot.index]
        branch = init_variant(variant, current, inputs[slot.index], model.settings)
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{variant.slot}:{variant.label}".encode()))
        loss = distill(branch, inputs[slot.index], targets, budget, generator)
        save_branch(path, branch, loss)
        elapsed = time.monotonic() - started
        eta = elapsed / done * (len(mine) - done)
        progress(f"bld: {done}/{len(mine)} slot {slot.index} ({slot.kind}, layer {slot.layer}) "
                 f"{variant.label}: nmse {loss:.4f}, eta {eta:.0f}s")
    parallel.barrier()
    branches: dict[tuple[int, str], Branch] = {}
    for options in variants:
        for variant in options:
            slot = slots[variant.slot]
            current = model.layer(slot).branch(slot.kind)
            if variant.is_current:
                branches[(variant.slot, variant.label)] = current
            elif variant.label == "noop":
                branches[(variant.slot, variant.label)] = None
            else:
                path = checkpoint_file(folder, variant)
                fresh = build_branch(slot.kind, variant.part, model.arch.hidden_size, model.settings)
                branches[(variant.slot, variant.label)] = load_branch(path, fresh)
                losses[f"{variant.slot}:{variant.label}"] = _saved_loss(path)
    return branches, losses


def _saved_loss(path: Path) -> float:
    with safe_open(str(path), framework="pt") as handle:
        return float((handle.metadata() or {}).get("nmse", "nan"))
