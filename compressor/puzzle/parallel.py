"""torch.distributed for the stages that split work across processes (`torchrun --nproc-per-node N`).

Rank 0 runs every other stage; the rest wait for it at the barriers. Without torchrun the world is one
process, still with a process group (of one), so GKD's FSDP2 runs the same code either way.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(hours=6)  # rank 0 scores and searches alone while the others wait


def init(device: torch.device) -> None:
    """Join the process group torchrun describes (gloo for CPU runs, nccl for GPU ones), or make one of this
    process."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=TIMEOUT)
    else:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=TIMEOUT)


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return rank_world()[0] == 0


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast(value: str) -> str:
    """Rank 0's `value` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def on_main(action: Callable[[], None], what: str) -> None:
    """Run `action` on rank 0 alone, then every rank raises if it failed: the others learn why at once instead
    of waiting at the next collective until torchrun tears the group down."""
    failure: Exception | None = None
    if is_main():
        try:
            action()
        except Exception as caught:  # raised below, on every rank
            failure = caught
    message = broadcast("" if failure is None else f"{what} failed on rank 0: {failure}")
    if message:
        raise RuntimeError(message) from failure


def finish() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def deal(costs: Mapping[int, float], rank: int, world: int) -> list[int]:
    """The items (keys of `costs`) rank `rank` takes: dealt most costly first to the least loaded rank."""
    load, owner = [0.0] * world, {}
    for item in sorted(costs, key=lambda key: (-costs[key], key)):
        least = min(range(world), key=lambda r: (load[r], r))
        owner[item] = least
        load[least] += costs[item]
    return sorted(item for item, r in owner.items() if r == rank)
