"""Freed heap memory goes back to the system where glibc would keep it resident: given back on demand
(`peaks.release_freed_memory`, which `LazyDecoder.layer` and BLD call), or never kept (`peaks.map_large_allocations`,
in the processes that only stream models)."""

from __future__ import annotations

import subprocess
import sys

MIB = 1 << 20
# A fresh process (a fresh allocator) allocates and frees a 16 MiB tensor three times, then prints how much more
# it holds than before. glibc raises its mmap threshold when the first one is freed and serves the next ones from
# the heap, which keeps them resident.
PROGRAM = """
import sys, torch
from tailor.compressor import peaks

def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

if sys.argv[1] == "mapped":
    peaks.map_large_allocations()
torch.ones(1 << 10).sum()  # torch's own first-use allocations
before = rss()
for _ in range(3):
    block = torch.ones(16 << 20, dtype=torch.uint8)
    del block
if sys.argv[1] == "released":
    peaks.release_freed_memory()
print(rss() - before)
"""


def kept_after_freeing(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_freed_blocks_glibc_keeps_resident_are_given_back() -> None:
    assert kept_after_freeing("kept") >= 12 * MIB  # the premise: glibc keeps the freed blocks resident
    assert kept_after_freeing("released") < 4 * MIB


def test_a_process_that_maps_large_blocks_never_keeps_them() -> None:
    assert kept_after_freeing("kept") >= 12 * MIB
    assert kept_after_freeing("mapped") < 4 * MIB
