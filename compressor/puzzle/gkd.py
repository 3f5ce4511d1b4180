"""Stage 7, global knowledge distillation (GKD): the assembled child learns from the parent end to end.

Loss = sum over layers of (1 - cos(h_child, h_parent)) + KL(parent || child) on the logits (Puzzle:
adding the LM loss hurt). The budget is `gkd.tokens` training tokens.

Memory per rank is bounded by sharding, not by the model's size:
- the child trains sharded across the ranks with PyTorch's FSDP2 (`fully_shard` per layer and at the root):
  each rank holds 1/world of its parameters, gradients and AdamW states, and one layer whole while it runs.
  It is built on the meta device and each rank copies in only its shard, one tensor at a time from the files.
  With `gkd.offload` those shards live in host memory (FSDP2's CPU offload): copied to the GPU at each gather,
  the gradients back at each backward, AdamW stepping on the host;
- the parent never trains. Where its shard fits beside the child's, it is sharded the same way and runs each
  step's forward with the child (`ShardedTeacher`); where it does not (a parent several times a rank's
  budget), each rank streams it, one layer resident, over the rows of its next steps, keeping the residual
  stream after every layer (BF16) for as many steps as WORKING_SHARE of the budget holds (`StreamedTeacher`).
  The rule is `footprint.teacher_is_sharded`, the dry run's;
- each step's batch (`gkd.batch`, rounded up to a whole number of sequences per rank) is split across the
  ranks, and the loss is scaled so the gradients FSDP averages are those of the whole batch: one process and
  several give the same child.
The trained child is written layer by layer (each layer gathered whole, written by rank 0). Training saves a
sharded, resumable checkpoint every `checkpointMinutes` (`resume.Checkpoints`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from tailor.compressor.model.checkpoint import read_config
from tailor.compressor.model.device import autocast
from tailor.compressor.model.lazy import LazyDecoder, recompute_rotary, sharded_checkpoint, sweep
from tailor.compressor.model.modeling import Decoder
from tailor.compressor.model.moe import PROJECTIONS, split_stacked
from tailor.compressor.model.training import Reporter
from tailor.compressor.puzzle import parallel, tokens
from tailor.compressor.puzzle.activations import Progress
from tailor.compressor.puzzle.footprint import KL_TOKENS, WORKING_SHARE, block_params, teacher_is_sharded
from tailor.compressor.puzzle.plan import Distillation
from tailor.compressor.puzzle.resume import Checkpoints, RunKey, child_digest

CHECKPOINT_FOLDER = "gkd-checkpoint"  # beside the trained child: stages/round{r}/gkd-checkpoint/


class ShardedTeacher:
    """The parent sharded across the ranks like the child: its states and logits computed step by step."""

    def __init__(self, parent: LazyDecoder) -> None:
        self.model = sharded_model(parent.folder, parent.device, parent.dtype).eval()
        for param in self.model.parameters():
            param.requires_grad_(False)

    def begin(self, step: int) -> None:
        """Step `step` (from 0) begins: nothing to prepare, each micro-batch's targets are computed then."""

    @torch.no_grad()
    def targets(self, rows: torch.Tensor, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        states: list[torch.Tensor] = []
        logits = self.model(ids, states=states)
        return states, logits


class StreamedTeacher:
    """The parent streamed over the rows of `per_pass` steps at a time: its residual stream after every layer
    (BF16; the last one float32) and its LM head."""

    def __init__(self, parent: LazyDecoder, batches: list[torch.Tensor], train: torch.Tensor, per_pass: int,
                 progress: Progress) -> None:
        self.parent, self.batches, self.train, self.per_pass, self.progress = parent, batches, train, per_pass, progress
        self.head = parent.head()
        self.first = self.until = 0  # the steps [first, until) the streamed states cover
        self.index: dict[int, int] = {}
        self.states: list[torch.Tensor] = []

    def begin(self, step: int) -> None:
        """Step `step` (from 0) begins: a new pass streams the parent when the states held do not cover it (a
        resumed run starts its first pass there)."""
        if not self.first <= step < self.until:
            self.first, self.until = step, step + self.per_pass
            self._stream(torch.unique(torch.cat(self.batches[self.first:self.until])))

    def targets(self, rows: torch.Tensor, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        positions = torch.tensor([self.index[int(row)] for row in rows], dtype=torch.long)
        states = [state[positions] for state in self.states]
        with torch.no_grad():
            return states, self.head(states[-1])

    def _stream(self, rows: torch.Tensor) -> None:
        self.progress(f"gkd: the parent, streamed over {rows.numel()} rows for the next {self.per_pass} steps")
        self.states = []
        self.index = {int(row): position for position, row in enumerate(rows)}
        parent = self.parent
        slots = parent.slots()
        firsts = {next(s.index for s in slots if s.layer == layer) for layer in range(1, len(parent.arch.blocks))}
        kept: list[torch.Tensor] = []
        with torch.no_grad():
            x = parent.embedding()(tokens.take(self.train, rows, parent.device))
            final = sweep(parent, x, lambda slot, state: kept.append(state.to(torch.bfloat16))
                          if slot.index in firsts else None)
        self.states = [*kept, final]  # after layer 0, 1, ..., the last


def steps_per_pass(rows_per_step: int, seq_len: int, arch_layers: int, hidden: int, budget_bytes: float | None,
                   steps: int) -> int:
    """Steps whose teacher states (BF16, every layer) fit WORKING_SHARE of the budget; all of them without one."""
    if budget_bytes is None:
        return steps
    per_step = max(1, rows_per_step) * seq_len * hidden * 2 * arch_layers
    return max(1, min(steps, int(WORKING_SHARE * budget_bytes // per_step)))


def sharded_model(folder: Path, device: torch.device, dtype: torch.dtype = torch.float32,
                  gathered: torch.dtype | None = None, offload: bool = False) -> Decoder:
    """The checkpoint in `folder` as a Decoder sharded with FSDP2 over every rank, read tensor by tensor, its
    shards in `dtype`; with `gathered`, a layer is gathered in that dtype to run (its gradients reduced in
    float32); with `offload`, the shards (and their gradients) are kept in host memory, the buffers on
    `device`."""
    lazy = LazyDecoder(folder, dtype=dtype, device=device)
    with torch.device("meta"):
        child = Decoder(lazy.arch, lazy.settings)
    mesh = init_device_mesh(device.type, (parallel.rank_world()[1],))
    # inputs are left as they are: casting them would copy the `states` list the forward appends to
    policy = MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=torch.float32 if gathered else None,
                                  cast_forward_inputs=False)
    offload_policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    for layer in child.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload_policy)
    fully_shard(child, mesh=mesh, mp_policy=policy, offload_policy=offload_policy)
    child.to_empty(device=torch.device("cpu") if offload else device)
    names = {id(p): name for name, p in reversed(list(child.named_parameters(remove_duplicate=False)))}
    with torch.no_grad():
        for param in child.parameters():
            full = _stored(lazy, names[id(param)], param)  # a tied head is named as the embedding here
            assert isinstance(param, DTensor)
            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements).to_local())
            del full
        for buffer_name, buffer in child.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(lazy.tensors([buffer_name])[buffer_name])
        for module in child.modules():  # FSDP2 offloads parameters only: buffers are where the forward runs
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
        recompute_rotary(child, device)
    return child


@torch.no_grad()
def clip_gradients(model: torch.nn.Module, max_norm: float, device: torch.device) -> None:
    """`torch.nn.utils.clip_grad_norm_` for FSDP2-sharded parameters wherever their shards live: each rank's
    share of the squared norm is summed on `device`, because NCCL reduces GPU tensors only and an offloaded
    shard's gradients are in host memory."""
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
    square = sum((grad.float().pow(2).sum().to(device) for grad in local), torch.zeros((), device=device))
    if dist.is_initialized():
        dist.all_reduce(square)
    coefficient = torch.clamp(max_norm / (square.sqrt() + 1e-6), max=1.0)
    for grad in local:
        grad.mul_(coefficient.to(grad.device, grad.dtype))


def chunked_kl(head: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               teacher_logits: torch.Tensor) -> torch.Tensor:
    """The sum over tokens of KL(teacher || child) on the logits, the child's from its last stream `x` through
    `head`, KL_TOKENS tokens at a time; with more than one chunk, each chunk's logits are recomputed in backward,
    so only one chunk's are ever held."""
    flat = x.reshape(-1, x.shape[-1])  # [tokens, hidden]
    teacher = teacher_logits.reshape(-1, teacher_logits.shape[-1])

    def part(rows: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        return F.kl_div(F.log_softmax(head(rows).float(), -1), F.log_softmax(wanted.float(), -1), log_target=True,
                        reduction="sum")

    if flat.shape[0] <= KL_TOKENS:
        return part(flat, teacher)
    return sum((checkpoint(part, flat[i:i + KL_TOKENS], teacher[i:i + KL_TOKENS], use_reentrant=False)
                for i in range(0, flat.shape[0], KL_TOKENS)), torch.zeros((), device=x.device))


def gkd_loss(child: Decoder, ids: torch.Tensor, teacher_states: list[torch.Tensor], teacher_logits: torch.Tensor,
             scale: float, recompute: bool = False) -> torch.Tensor:
    """This rank's share of the batch loss: the sums over its rows, times `scale` (world / batch rows). A child
    narrower than the parent (fewer embedding channels: the Minitron baseline of `bench/puzzle.py`) has no layer
    states to compare and learns from the logits alone, as Minitron distils."""
    states: list[torch.Tensor] = []
    kl: torch.Tensor = child(ids, states=states, recompute=recompute,
                             loss=lambda head, x: chunked_kl(head, x, teacher_logits)) / ids.shape[1]
    if states[0].shape[-1] != teacher_states[0].shape[-1]:
        return kl * scale
    cosine = sum((1 - F.cosine_similarity(c.float(), p.float(), dim=-1)).mean(-1).sum()
                 for c, p in zip(states, teacher_states, strict=True))
    return (cosine + kl) * scale


def distill(child_folder: Path, out: Path, parent: LazyDecoder, parent_folder: Path, train: torch.Tensor,
            budget: Distillation, seed: int, progress: Progress, budget_bytes: float | None = None,
            checkpoint_seconds: float = 1800.0) -> list[float]:
    """Train the child in `child_folder` into `out` (rank 0 writes it) on windows of `train` (token ids, may be
    memory-mapped: a step's rows are read as it takes them); the loss of every step. `budget_bytes`:
    the memory per rank the teacher's states may take a quarter of. Every `checkpoint_seconds` the training
    state is saved beside `out` (`resume.Checkpoints`), and a run of the same GKD resumes from it; the caller
    clears it (`Checkpoints.clear`) once the child is recorded."""
    rank, world = parallel.rank_world()
    per_step = -(-budget.batch // world) * world  # gkd.batch, rounded up to a whole number of rows per rank
    steps = max(1, math.ceil(budget.tokens / (per_step * train.shape[1])))
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, train.shape[0], (per_step,), generator=generator) for _ in range(steps)]
    mine = [rows[rank::world] for rows in batches]
    teacher: ShardedTeacher | StreamedTeacher
    child_arch = LazyDecoder(child_folder).arch
    largest = max(block_params(child_arch))
    if teacher_is_sharded(parent.dtype.itemsize * parent.arch.total_params, child_arch.total_params, largest, world,
                          budget_bytes, budget.offload):
        progress("gkd: the parent sharded across the ranks")
        teacher = ShardedTeacher(parent)
    else:
        per_pass = steps_per_pass(mine[0].numel(), train.shape[1], len(parent.arch.blocks), parent.arch.hidden_size,
                                  budget_bytes, steps)
        teacher = StreamedTeacher(parent, mine, train, per_pass, progress)
    child = sharded_model(child_folder, parent.device, gathered=torch.bfloat16 if parent.dtype == torch.bfloat16
                          else None, offload=budget.offload)
    optimiser = torch.optim.AdamW(child.parameters(), lr=budget.lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    key = RunKey(child=child_digest(child_folder), steps=steps, rows_per_step=per_step, world=world, seed=seed,
                 lr=budget.lr)
    checkpoints = Checkpoints(out.with_name(CHECKPOINT_FOLDER), key, checkpoint_seconds, child, optimiser, schedule,
                              progress)
    done, losses = checkpoints.resume()
    precision = autocast(parent.device, parent.dtype)  # the run's compute dtype, as the teacher is held in
    child.train()
    started, reporter = time.monotonic(), Reporter(steps, 5)
    for step, rows in enumerate(mine[done:], done + 1):
        teacher.begin(step - 1)
        optimiser.zero_grad(set_to_none=True)
        total = torch.zeros((), device=parent.device)
        for part in torch.split(rows, budget.micro_batch or rows.numel()):  # the step's gradients add up
            ids = tokens.take(train, part, parent.device)
            states, logits = teacher.targets(part, ids)
            with precision:
                loss = gkd_loss(child, ids, states, logits, world / per_step, budget.recompute)
            loss.backward()  # type: ignore[no-untyped-call]
            total += loss.detach().float()
            del states, logits, loss
        clip_gradients(child, 1.0, parent.device)
        optimiser.step()
        schedule.step()
        total /= world
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(float(total))
        if reporter.due(step):
            eta = (time.monotonic() - started) / (step - done) * (steps - step)
            progress(f"gkd: step {step}/{steps}, {step * per_step * train.shape[1]} tokens, "
                     f"loss {losses[-1]:.4f}, eta {eta:.0f}s")
        checkpoints.after_step(step, losses)
    del teacher, optimiser, checkpoints
    _write(child, out, parent_folder, child_folder)
    return losses


def _stored(lazy: LazyDecoder, name: str, param: torch.Tensor) -> torch.Tensor:
    """Parameter `name` as `lazy` stores it: stacked experts are stored one by one."""
    prefix, _, projection = name.rpartition(".")
    if not (prefix.endswith(".experts") and projection in PROJECTIONS):
        return lazy.tensors([name])[name]
    return lazy.stacked(f"{prefix}.", projection, param.shape[0])


@torch.no_grad()
def _write(child: Decoder, out: Path, parent_folder: Path, child_folder: Path) -> None:
    """Every rank gathers one layer at a time; rank 0 writes it."""
    config = read_config(child_folder)
    prefix = child.body
    groups: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(len(child.layers) + 1)]
    for name, value in child.state_dict().items():
        if child.arch.tie_word_embeddings and name == "lm_head.weight":
            continue
        layer = int(name.split(".")[2]) if name.startswith(f"{prefix}.layers.") else len(child.layers)
        groups[layer].append((name, value))

    def gather(value: torch.Tensor) -> torch.Tensor:
        if not isinstance(value, DTensor):
            return value
        where = value.device_mesh.device_type  # an offloaded shard is gathered on the GPUs
        placed = value if value.device.type == where else value.to(where)
        assert isinstance(placed, DTensor)
        whole: torch.Tensor = placed.full_tensor()
        return whole

    if parallel.is_main():
        with sharded_checkpoint(out, {k: v for k, v in config.items() if k != "torch_dtype"}, parent_folder,
                                len(groups)) as writer:
            for group in groups:
                tensors = {name: gather(value) for name, value in group}
                for prefix in {name.rpartition(".")[0] + "." for name in tensors}:
                    split_stacked(tensors, prefix)
                writer.add(tensors)
    else:
        for group in groups:
            for _, value in group:
                gather(value)
    parallel.barrier()
