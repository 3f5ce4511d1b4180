"""torch.distributed for the stages that split work across processes (`torchrun --nproc-per-node N`).

Rank 0 runs every other stage; the rest wait for it at the barriers. Without torchrun the world is one
process and every call here is a no-op.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(hours=6)  # rank 0 scores and searches alone while the others wait


def init() -> None:
    """Join the process group torchrun describes (gloo on CPU, nccl on GPUs); nothing without torchrun."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=TIMEOUT)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return rank_world()[0] == 0


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def finish() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
