"""oneDNN's kernel cache on the CPU: resident memory, kernel builds and step time at its default capacity (1024)
and at the 64 `tailor` sets (`cli/main.py`, ONEDNN_PRIMITIVE_CACHE_CAPACITY).

Two workloads, each in a fresh process per capacity (oneDNN reads the capacity when it builds its first kernel),
the capacities alternated over ROUNDS rounds, medians reported:
- varying shapes, as a MoE's experts train in BLD: one BF16 linear (2048 -> 1024) forward and backward on 300
  token counts from 1 to 997; the process's peak resident set;
- fixed shapes, as a dense layer trains: seven BF16 linears of SmolLM2's shapes on 512 tokens, forward and
  backward; the median step time over 40 steps (after 5 warm-up steps) and the peak resident set.
Each run also counts the kernels oneDNN built because its cache lacked them (`ONEDNN_VERBOSE=profile_create`,
`create:cache_miss`): unlike a time on a shared machine, that count cannot be noise. A capacity that made a
workload slower would show as more misses.

    .venv/bin/python bench/kernel_cache.py      # prints a table, writes bench/results/kernel_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tailor.cli.main import KERNEL_CACHE

ROOT = Path(__file__).resolve().parent.parent
VARIABLE, CAP = KERNEL_CACHE
CAPACITIES = (1024, int(CAP))  # oneDNN's default, and tailor's
ROUNDS = 3


def varying_shapes() -> dict[str, float]:
    import torch
    torch.manual_seed(0)
    weight = torch.randn(1024, 2048, requires_grad=True)
    for step in range(300):
        x = torch.randn(1 + (step * 37) % 997, 2048)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.nn.functional.linear(x, weight)
        y.float().sum().backward()
    return {}


def fixed_shapes() -> dict[str, float]:
    import time

    import torch
    torch.manual_seed(0)
    hidden, kv, ffn = 576, 192, 1536
    weights = [torch.randn(out, inp, requires_grad=True) for out, inp in
               ((hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden))]
    down = torch.randn(hidden, ffn, requires_grad=True)
    x = torch.randn(512, hidden)
    times = []
    for step in range(45):
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs = [torch.nn.functional.linear(x, w) for w in weights]
            outputs.append(torch.nn.functional.linear(outputs[-1], down))
        sum(out.float().sum() for out in outputs).backward()
        if step >= 5:
            times.append(time.perf_counter() - started)
    return {"step_ms": statistics.median(times) * 1e3}


WORKLOADS = {"varying shapes": varying_shapes, "fixed shapes": fixed_shapes}


def measure(workload: str, capacity: int) -> dict[str, float]:
    """Run one workload in a fresh process at one cache capacity; oneDNN's verbose lines share its stdout."""
    env = {**os.environ, VARIABLE: str(capacity), "ONEDNN_VERBOSE": "profile_create"}
    lines = subprocess.run([sys.executable, __file__, "--one", workload], env=env, check=True, capture_output=True,
                           text=True).stdout.splitlines()
    return {**json.loads(lines[-1]), "kernel_builds": sum(",create:cache_miss," in line for line in lines)}


def median_row(workload: str, capacity: int, runs: list[dict[str, float]]) -> dict[str, Any]:
    return {"workload": workload, "capacity": capacity, "runs": runs,
            **{key: statistics.median(run[key] for run in runs) for key in runs[0]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "kernel_cache.json")
    args = parser.parse_args()
    if args.one:
        from tailor.compressor import peaks
        figures = WORKLOADS[args.one]()
        print(json.dumps({**figures, "peak_rss_mib": peaks.read()["rss"] / 2**20}))
        return
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for round_ in range(ROUNDS):
        for workload in WORKLOADS:
            for capacity in CAPACITIES[::1 if round_ % 2 == 0 else -1]:
                runs.setdefault((workload, capacity), []).append(measure(workload, capacity))
    rows = [median_row(workload, capacity, found) for (workload, capacity), found in runs.items()]
    print(f"{'workload':<16}{'capacity':>10}{'peak RSS MiB':>14}{'kernel builds':>15}{'step ms':>10}")
    for row in rows:
        step = f"{row['step_ms']:.2f}" if "step_ms" in row else "-"
        print(f"{row['workload']:<16}{row['capacity']:>10}{row['peak_rss_mib']:>14.0f}{row['kernel_builds']:>15.0f}"
              f"{step:>10}")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"measured": f"this machine, medians of {ROUNDS} runs", "rows": rows},
                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
