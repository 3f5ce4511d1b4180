"""Routed experts as two grouped GEMMs (`moe.Experts`, what compression trains and runs) against one module per
expert run in a Python loop (`moe.ExpertList`, the form modelopt quantizes, and the only form before): the same
weights, tokens and routing; the time of a training step (forward and backward of float32 weights under BF16
autocast, as BLD and GKD train) and of a forward without gradients (BF16, as frozen blocks run in BLD's capture
and scoring), and their agreement (float32).

Each layout is timed in turn, `--repeats` interleaved pairs after a warm-up, and the median ratio reported with
its range: the machine is shared, so only a ratio measured side by side means anything. Shapes, scaled from the
Nemotron-3 MoE layers where a CPU cannot hold them (their expert counts and top-k kept, narrower):

    .venv/bin/python bench/moe_experts.py      # ~3 min here; prints a table, writes bench/results/moe_experts.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tailor.compressor.model.moe import ExpertList, Experts

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # name: (experts, top-k, inputs, width, tokens)
    "toy (the tests' tiny NemotronH)": (8, 2, 64, 64, 512),
    "Nemotron-3-Nano's routing, narrowed": (128, 6, 256, 512, 2048),
    "Nemotron-3-Super's routing, narrowed": (512, 22, 256, 256, 1024),
}


def layouts(experts: int, inputs: int, width: int) -> tuple[Experts, ExpertList]:
    """Stacked experts and a loop over independent copies of the same weights (each with its own gradient)."""
    torch.manual_seed(0)
    stacked = Experts(experts, inputs, width)
    loop = ExpertList(stacked[index] for index in range(experts))
    for expert in loop:
        for linear in (expert.up_proj, expert.down_proj):
            linear.weight = torch.nn.Parameter(linear.weight.detach().clone())
    return stacked, loop


def timed(step: Callable[[], None]) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def compare(name: str, shape: tuple[int, int, int, int, int], repeats: int) -> dict[str, Any]:
    experts, top_k, inputs, width, tokens = shape
    stacked, loop = layouts(experts, inputs, width)
    generator = torch.Generator().manual_seed(1)
    latent = torch.randn(tokens, inputs, generator=generator)
    scores = torch.rand(tokens, experts, generator=generator)
    weights, chosen = scores.topk(top_k, dim=-1)

    def train(module: torch.nn.Module) -> Callable[[], None]:
        def step() -> None:
            x = latent.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = module(x, weights, chosen)
            out.square().mean().backward()
        return step

    def infer(module: torch.nn.Module) -> Callable[[], None]:
        frozen = copy.deepcopy(module).to(torch.bfloat16)

        def step() -> None:
            with torch.no_grad():
                frozen(latent.to(torch.bfloat16), weights, chosen)
        return step

    x = latent.clone().requires_grad_(True)
    grouped_out = stacked(x, weights, chosen)
    (grouped_grad,) = torch.autograd.grad(grouped_out.square().mean(), x)
    y = latent.clone().requires_grad_(True)
    loop_out = loop(y, weights, chosen)
    (loop_grad,) = torch.autograd.grad(loop_out.square().mean(), y)
    grouped_out, loop_out = grouped_out.detach(), loop_out.detach()
    row: dict[str, Any] = {
        "shape": name, "experts": experts, "top_k": top_k, "inputs": inputs, "width": width, "tokens": tokens,
        "max_output_difference": float((grouped_out - loop_out).abs().max() / loop_out.abs().max()),
        "max_input_gradient_difference": float((grouped_grad - loop_grad).abs().max() / loop_grad.abs().max())}
    for mode, make in (("train", train), ("forward_bf16", infer)):
        steps = {"loop": make(loop), "grouped": make(stacked)}
        for step in steps.values():
            step()  # warm-up: kernels built, allocator filled
        seconds: dict[str, list[float]] = {"loop": [], "grouped": []}
        for _ in range(repeats):
            for layout, step in steps.items():
                seconds[layout].append(timed(step))
        ratios = [a / b for a, b in zip(seconds["loop"], seconds["grouped"], strict=True)]
        row[mode] = {"loop_s": statistics.median(seconds["loop"]), "grouped_s": statistics.median(seconds["grouped"]),
                     "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved pairs per shape and mode")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "moe_experts.json")
    args = parser.parse_args()
    rows = []
    print(f"{'shape':40} {'mode':13} {'loop s':>8} {'grouped s':>10} {'speedup':>8}  range")
    for name, shape in SHAPES.items():
        row = compare(name, shape, args.repeats)
        rows.append(row)
        for mode in ("train", "forward_bf16"):
            figures = row[mode]
            low, high = figures["speedup_range"]
            print(f"{name:40} {mode:13} {figures['loop_s']:8.3f} {figures['grouped_s']:10.3f} "
                  f"{figures['speedup']:7.2f}x  {low:.2f}-{high:.2f}")
        print(f"{'':40} agreement: output {row['max_output_difference']:.1e}, "
              f"input gradient {row['max_input_gradient_difference']:.1e} (relative)")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({
        "measured": f"this machine ({torch.get_num_threads()} threads), medians of {args.repeats} interleaved pairs",
        "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
