"""NVFP4 quality on CPU through the pure-torch emulation: BF16 vs W4A16 vs W4A4 (modelopt's NVFP4 packing,
the precision recipe's tensor groups), perplexity and KL to the parent on held-out Shakespeare.

    .venv/bin/python bench/nvfp4_emulation.py [--model DIR ...]   # ~2 min per model on 2 cores

Without --model it measures SmolLM2-135M and, when present, the Puzzle child of `bench/puzzle.py`.
Weights are rounded to nearest with per-block max scales, activations quantized per block at run time.
This is a baseline without calibration, not modelopt's calibrated PTQ.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from transformers import AutoTokenizer

from tailor.compressor.checkpoint import load_decoder
from tailor.compressor.hardware import Precision
from tailor.compressor.memory import recipe_for
from tailor.compressor.puzzle.data import load_splits
from tailor.compressor.puzzle.evaluate import quality
from tailor.compressor.puzzle.pipeline import resolve_parent
from tailor.compressor.puzzle.plan import Plan
from tailor.compressor.quantize.nvfp4 import emulate

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", type=Path, default=ROOT / "examples" / "plans" / "smollm2-cpu.yaml")
    parser.add_argument("--model", type=Path, action="append", help="a model folder (default: parent and child)")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "nvfp4_emulation.json")
    args = parser.parse_args()
    plan = Plan.load(args.plan)
    parent_dir = resolve_parent(plan.parent)
    parent = load_decoder(parent_dir).eval()
    held_out = load_splits(plan, AutoTokenizer.from_pretrained(parent_dir)).evaluation
    child = ROOT / "build" / "bench-puzzle" / "puzzle-1.5x" / "child"
    folders = args.model or [parent_dir, *([child] if child.exists() else [])]
    rows = []
    for folder in folders:
        model = load_decoder(folder).eval()
        recipe = recipe_for(Precision.NVFP4, model.arch)
        for label, inputs in (("bf16", None), ("nvfp4 W4A16", False), ("nvfp4 W4A4", True)):
            variant = copy.deepcopy(model)
            if inputs is not None:
                emulate(variant, recipe, quantize_inputs=inputs)
            figures = quality(variant, parent, held_out)
            rows.append({"model": str(folder), "precision": label, "recipe": recipe.name,
                         "perplexity": figures.perplexity, "kl": figures.kl})
            print(f"{folder.name:<24} {label:<12} ppl {figures.perplexity:8.2f}  KL {figures.kl:.4f}", flush=True)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"plan": str(args.plan), "tokens": held_out.numel(), "rows": rows},
                                       indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
