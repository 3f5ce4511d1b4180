"""Puzzle vs uniform FFN pruning vs dropping layers, at matched measured decode speed, on SmolLM2-135M.

For each throughput target: run `tailor compress` (the second target reuses the first run's BLD and
scores), then build both baselines from the parent at the Puzzle child's measured speed:
- uniform FFN pruning: every FFN cut to one width (channel contribution, as Puzzle's library does),
  the widest width whose measured decode speed reaches the Puzzle child's;
- layer dropping: whole layers removed in order of least Block Influence (1 - cos(input, output) of
  the layer on calibration text, as ShortGPT ranks them), the fewest that reach the same speed.
Both baselines then get the Puzzle child's GKD token budget. Every model is timed in one harness, in
this process, and scored on the same held-out text.

    .venv/bin/python bench/puzzle.py                  # ~45 min on 2 cores; writes bench/results/puzzle.{json,png}
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from tailor.compressor.architecture import Block, Mlp, NoOp, Part
from tailor.compressor.checkpoint import load_decoder, save_decoder
from tailor.compressor.lazy import LazyDecoder
from tailor.compressor.modeling import Branch, Decoder
from tailor.compressor.puzzle import gkd, parallel
from tailor.compressor.puzzle.data import load_splits
from tailor.compressor.puzzle.evaluate import decode_tokens_per_second, quality
from tailor.compressor.puzzle.library import Variant, init_variant
from tailor.compressor.puzzle.pipeline import resolve_parent
from tailor.compressor.puzzle.plan import Plan

ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def speed(model: Decoder, plan: Plan) -> float:
    return decode_tokens_per_second(model, plan.target.batch, plan.target.context, plan.measure_tokens)


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


@torch.no_grad()
def build(parent: Decoder, chosen: list[tuple[Part, Branch]]) -> Decoder:
    """A Decoder with one (part, branch) per parent slot; embeddings, final norm and head the parent's."""
    slots = parent.slots()
    parts = {(slot.layer, slot.kind): part for slot, (part, _) in zip(slots, chosen, strict=True)}
    blocks = [Block(mixer=parts.get((i, "mixer")), ffn=parts.get((i, "ffn"))) for i in range(len(parent.arch.blocks))]
    child = Decoder(parent.arch.model_copy(update={"blocks": blocks}), parent.settings)
    child.embedding.load_state_dict(parent.embedding.state_dict())
    child.final_norm.load_state_dict(parent.final_norm.state_dict())
    if not parent.arch.tie_word_embeddings:
        child.lm_head.load_state_dict(parent.lm_head.state_dict())
    for slot, (_, source) in zip(child.slots(), chosen, strict=True):
        target = child.layer(slot).branch(slot.kind)
        assert (source is None) == (target is None), f"slot {slot.index}: branch does not match its part"
        for into, weights in zip(target or (), source or (), strict=True):
            into.load_state_dict(weights.state_dict())
    return child.to(parent.embedding.weight.dtype).eval()


@torch.no_grad()
def uniform_ffn(parent: Decoder, width: int, inputs: list[torch.Tensor]) -> Decoder:
    """Every FFN cut to `width` channels by channel contribution; attention untouched."""
    chosen: list[tuple[Part, Branch]] = []
    for slot in parent.slots():
        part = Mlp(intermediate_size=width, gated=True) if slot.kind == "ffn" else slot.part
        variant = Variant(slot=slot.index, kind=slot.kind, part=part, is_current=part == slot.part)
        chosen.append((part, init_variant(variant, parent.layer(slot).branch(slot.kind), inputs[slot.index],
                                          parent.settings)))
    return build(parent, chosen)


@torch.no_grad()
def block_influence(parent: Decoder, ids: torch.Tensor) -> list[float]:
    """ShortGPT's Block Influence per layer: mean 1 - cos(layer input, layer output)."""
    x = parent.embed(ids)
    out = []
    for layer in parent.layers:
        y = layer(x)
        out.append(float((1 - torch.nn.functional.cosine_similarity(x, y, dim=-1)).mean()))
        x = y
    return out


@torch.no_grad()
def drop_layers(parent: Decoder, layers: set[int]) -> Decoder:
    return build(parent, [(NoOp(), None) if slot.layer in layers else (slot.part, parent.layer(slot).branch(slot.kind))
                          for slot in parent.slots()])


def matched(candidates: list[tuple[str, Any]], build: Any, goal: float, plan: Plan) -> tuple[str, Decoder, float,
                                                                                              bool]:
    """The first candidate (least compressed first) whose measured speed reaches `goal`, else the last one."""
    model, measured = None, 0.0
    for name, knob in candidates:
        model = build(knob)
        measured = speed(model, plan)
        log(f"  {name}: {measured:.1f} tokens/s (goal {goal:.1f})")
        if measured >= goal:
            return name, model, measured, True
    assert model is not None
    return candidates[-1][0], model, measured, False


def evaluate(name: str, folder: Path, parent: LazyDecoder, splits: Any, seconds: dict[str, float]) -> dict:
    model = LazyDecoder(folder)
    q = quality(model, parent, splits.evaluation)
    return {"name": name, "params": model.arch.total_params, "pattern": model.arch.pattern,
            "perplexity": q.perplexity, "kl": q.kl, "stage_seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", type=Path, default=ROOT / "examples" / "plans" / "smollm2-cpu.yaml")
    parser.add_argument("--targets", type=float, nargs="+", default=[1.5, 1.25])
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "bench-puzzle")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "puzzle.json")
    args = parser.parse_args()
    base = Plan.load(args.plan)
    parent_dir = resolve_parent(base.parent)
    parallel.init(torch.device("cpu"))  # GKD needs a process group (one process here)
    parent = load_decoder(parent_dir).eval()
    parent_lazy = LazyDecoder(parent_dir)
    splits = load_splits(base, AutoTokenizer.from_pretrained(parent_dir))
    calibration = splits.train[:-(-base.bld_activation_tokens // base.data.seq_len)]
    inputs = capture_inputs(parent, calibration, base.bld.batch)
    influence = block_influence(parent, calibration[:16])
    drop_order = sorted(range(len(influence)), key=lambda i: influence[i])
    from tailor.compressor.puzzle.pipeline import compress

    rows: list[dict[str, Any]] = []
    first_out: Path | None = None
    for target in args.targets:
        plan = base.model_copy(update={"target": base.target.model_copy(update={"throughput": target})})
        out = args.work / f"puzzle-{target}x"
        if first_out is not None and not out.exists():
            shutil.copytree(first_out / "stages", out / "stages")  # same library: reuse BLD and scores
        log(f"Puzzle at {target}x")
        report = compress(plan, out)
        assert report is not None
        first_out = first_out or out
        goal = speed(load_decoder(out / "child").eval(), plan)
        puzzle_seconds = {k: v for k, v in report.stage_seconds.items() if k.startswith("round")}
        models = [("puzzle", out / "child", goal, True, puzzle_seconds)]
        ffn_width = parent.arch.blocks[0].ffn.intermediate_size  # type: ignore[union-attr]
        widths = [w for w in range(ffn_width - 128, 15, -128)] + [64, 32, 16]
        baselines = [("uniform", "uniform {}", [(f"ffn width {w}", w) for w in widths],
                      lambda w: uniform_ffn(parent, w, inputs)),
                     ("drop", "{} (block influence)", [(f"drop {k} layers", k) for k in range(1, len(drop_order))],
                      lambda k: drop_layers(parent, set(drop_order[:k])))]
        for kind, template, candidates, builder in baselines:
            started = time.monotonic()
            name, model, measured, reached = matched(candidates, builder, goal, plan)
            seconds = {"search": time.monotonic() - started}
            label, folder = template.format(name), args.work / f"{kind}-{target}x"
            save_decoder(model, folder / "assembled", parent_dir)
            del model
            log(f"GKD for {label}")
            began = time.monotonic()
            parallel.init(torch.device("cpu"))  # compress() closes its process group when it returns
            gkd.distill(folder / "assembled", folder / "child", parent_lazy, parent_dir, splits.train, plan.gkd,
                        plan.seed, log)
            seconds["gkd"] = time.monotonic() - began
            models.append((label, folder / "child", measured, reached, seconds))
        for label, child_dir, measured, reached, seconds in models:
            row = evaluate(label, child_dir, parent_lazy, splits, seconds)
            row.update(target=target, tokens_per_second=measured, reached_goal=reached)
            rows.append(row)
            log(f"{label}: ppl {row['perplexity']:.3f}, kl {row['kl']:.4f}, {measured:.1f} tokens/s")
    parallel.finish()
    parent_speed = speed(parent, base)
    parent_quality = quality(parent_lazy, parent_lazy, splits.evaluation)
    for row in rows:
        row["speedup"] = row["tokens_per_second"] / parent_speed
    result = {"plan": str(args.plan), "device": "cpu", "threads": torch.get_num_threads(),
              "parent": {"params": parent.arch.total_params, "perplexity": parent_quality.perplexity,
                         "tokens_per_second": parent_speed},
              "gkd_tokens": base.gkd.tokens, "bld_tokens_per_variant": base.bld.tokens, "rows": rows}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    print(f"parent: ppl {parent_quality.perplexity:.3f}, {parent_speed:.1f} tokens/s, {parent.arch.total_params:,} "
          "params")
    print(f"{'target':>6} {'model':<44} {'tok/s':>7} {'speedup':>7} {'ppl':>8} {'KL':>7} {'params':>12}")
    for row in rows:
        print(f"{row['target']:>6} {row['name']:<44} {row['tokens_per_second']:>7.1f} {row['speedup']:>7.3f} "
              f"{row['perplexity']:>8.3f} {row['kl']:>7.4f} {row['params']:>12,}")
    plot(result, args.results.with_suffix(".png"))
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    markers = {"puzzle": "*", "uniform": "s", "drop": "^"}
    for row in result["rows"]:
        kind = row["name"].split()[0]
        axes.scatter(row["speedup"], row["perplexity"], marker=markers[kind], s=120 if kind == "puzzle" else 60,
                     label=f"{row['name']} ({row['target']}x target)")
    axes.axhline(result["parent"]["perplexity"], color="grey", linestyle="--", label="parent")
    axes.set_xlabel("measured decode speed-up vs parent (CPU, batch 1)")
    axes.set_ylabel("held-out perplexity (Shakespeare)")
    axes.set_title("SmolLM2-135M: Puzzle vs baselines at matched speed, same GKD budget")
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
