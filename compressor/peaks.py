"""A process's peak memory over a stretch of work: resident set (Linux `VmHWM`, reset through
`/proc/self/clear_refs`) and, on a GPU, the CUDA allocator's peak."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path

import torch

STATUS, CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MAPPED_FROM = 1 << 20  # bytes: blocks this large are mapped, and unmapped when freed, in processes that train nothing


def release_freed_memory() -> None:
    """Give the memory glibc's heap holds free back to the system (`malloc_trim`; a no-op off glibc).
    `LazyDecoder.layer` calls it before it reads a layer. BLD calls it after each variant: a MoE variant's
    experts see new token counts, so new tensor sizes, at every step, and without it a NemotronH rank's resident
    set grew to 2.6 times what BLD holds. (Lowering glibc's mmap threshold instead kept it flat too, but slowed
    BF16 training on the CPU by about 30%.)"""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def map_large_allocations() -> None:
    """Serve every block of MAPPED_FROM bytes or more with its own mmap, given back the moment it is freed
    (glibc `mallopt(M_MMAP_THRESHOLD)`; a no-op off glibc), for processes that only stream models (`tailor
    quantize`, `tailor evaluate`). glibc otherwise raises its threshold each time a large block is freed and
    serves the next layer's tensors from the heap, which keeps them: on the memory benchmark's child, quantization's
    calibration peaked at 1.71 GiB and its evaluation at 1.64 without it, 1.58 and 1.44 with it. Not for
    training: mapping every step's tensors slowed BF16 training on the CPU by about 30%."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)


def reset() -> None:
    """Start a new peak: unreachable objects are collected (a sharded model is held in reference cycles), freed
    heap memory goes back to the system (glibc `malloc_trim`), then the resident set's high-water mark drops to
    the current size."""
    gc.collect()
    release_freed_memory()
    with contextlib.suppress(OSError):  # not Linux, or not allowed: the peak is then the lifetime peak
        CLEAR.write_text("5")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def read() -> dict[str, int]:
    """Bytes: `rss`, the resident set's peak since `reset`; `cuda`, the allocator's peak on this device."""
    out: dict[str, int] = {}
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                out["rss"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    if torch.cuda.is_available():
        out["cuda"] = int(torch.cuda.max_memory_allocated())
    return out


def describe(peak: dict[str, int]) -> str:
    return ", ".join(f"{kind} {value / 2**30:.2f} GiB" for kind, value in peak.items()) or "unknown"
