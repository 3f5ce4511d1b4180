"""Puzzle vs uniform FFN pruning vs dropping layers, at matched measured decode speed, on SmolLM2-135M, in the
training text's domain and outside it, over several runs.

Each run (its own seed) and throughput target: run `tailor compress` (a second target reuses the run's BLD and
scores), then build both baselines from the parent at the Puzzle child's measured speed:
- uniform FFN pruning: every FFN cut to one width (channel contribution, as Puzzle's library does),
  the widest width whose measured decode speed reaches the Puzzle child's;
- layer dropping: whole layers removed in order of least Block Influence (1 - cos(input, output) of
  the layer on calibration text, as ShortGPT ranks them), the fewest that reach the same speed.
Both baselines then get the Puzzle child's GKD token budget. Every model's speed-up is measured in one harness,
in this process, as `tailor compress` checks its child: the median of paired decode steps, the model's beside the
parent's (`calibration.measured_speedup`), so a machine that slows down during a run slows both sides of every
pair and cannot decide a match. Every model is scored on the same text: the plan's held-out documents
(in-domain: works of the training corpus no stage trains on) and corpora of other genres no stage ever reads
(out-of-domain: news articles and Python's reference documentation by default). The summary gives each model's
mean and spread over the runs.

    .venv/bin/python bench/puzzle.py      # 3 runs at 1.5x, ~15 min each on 2 cores; bench/results/puzzle.{json,png}
    .venv/bin/python bench/puzzle.py --runs 1 --set rounds=2 --results build/puzzle-rounds2.json   # a plan variant
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import ValidationError
from transformers import AutoTokenizer

from tailor.compressor.architecture import Block, Mlp, NoOp, Part
from tailor.compressor.checkpoint import load_decoder, save_decoder
from tailor.compressor.costs import Phase, Workload
from tailor.compressor.lazy import LazyDecoder
from tailor.compressor.modeling import Branch, Decoder
from tailor.compressor.puzzle import bld, gkd, parallel
from tailor.compressor.puzzle.calibration import measured_speedup
from tailor.compressor.puzzle.data import documents, load_splits, text_files, token_windows
from tailor.compressor.puzzle.evaluate import quality
from tailor.compressor.puzzle.library import Variant, init_variant
from tailor.compressor.puzzle.pipeline import resolve_parent
from tailor.compressor.puzzle.plan import Plan, problems

ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def speedup(parent: Decoder, model: Decoder, plan: Plan) -> float:
    """`model`'s decode speed-up over `parent` at the plan's batch and context, from paired steps."""
    work = Workload(phase=Phase.DECODE, batch=plan.target.batch, context=plan.target.context)
    return measured_speedup(parent, model, work)


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
                                          parent.settings, bld.EVAL_ROWS)))
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


def matched(parent: Decoder, candidates: list[tuple[str, Any]], build: Any, goal: float,
            plan: Plan) -> tuple[str, Decoder, float, bool]:
    """The first candidate (least compressed first) whose measured speed-up over `parent` reaches `goal`, else the
    last one."""
    model, measured = None, 0.0
    for name, knob in candidates:
        model = build(knob)
        measured = speedup(parent, model, plan)
        log(f"  {name}: {measured:.3f}x (goal {goal:.3f}x)")
        if measured >= goal:
            return name, model, measured, True
    assert model is not None
    return candidates[-1][0], model, measured, False


IN_DOMAIN = "in-domain"


def evaluate(name: str, folder: Path, parent: LazyDecoder, texts: dict[str, torch.Tensor],
             seconds: dict[str, float]) -> dict[str, Any]:
    """Perplexity and KL to the parent on each text (the in-domain held-out split and every other domain)."""
    model = LazyDecoder(folder)
    scores = {domain: quality(model, parent, ids) for domain, ids in texts.items()}
    return {"name": name, "kind": name.split()[0], "params": model.arch.total_params, "pattern": model.arch.pattern,
            "domains": {domain: {"perplexity": q.perplexity, "kl": q.kl} for domain, q in scores.items()},
            "stage_seconds": seconds}


def run(base: Plan, parent_dir: Path, targets: list[float], work: Path, texts_of: Any) -> list[dict[str, Any]]:
    """One run: for each target, Puzzle and both baselines at its measured speed, each scored on every text."""
    parallel.init(torch.device("cpu"))  # GKD needs a process group (one process here)
    parent = load_decoder(parent_dir).eval()
    parent_lazy = LazyDecoder(parent_dir)
    splits = load_splits(base, AutoTokenizer.from_pretrained(parent_dir), work / "tokens")
    texts = texts_of(splits)
    calibration = splits.train[:-(-base.bld_activation_tokens // base.data.seq_len)].long()
    inputs = capture_inputs(parent, calibration, base.bld.batch)
    influence = block_influence(parent, calibration[:16])
    drop_order = sorted(range(len(influence)), key=lambda i: influence[i])
    from tailor.compressor.puzzle.pipeline import compress

    rows: list[dict[str, Any]] = []
    first_out: Path | None = None
    for target in targets:
        plan = base.model_copy(update={"target": base.target.model_copy(update={"throughput": target})})
        out = work / f"puzzle-{target}x"
        if first_out is not None and not out.exists():
            shutil.copytree(first_out / "stages", out / "stages")  # same library: reuse BLD and scores
        log(f"Puzzle at {target}x (seed {base.seed})")
        report = compress(plan, out)
        assert report is not None
        first_out = first_out or out
        goal = speedup(parent, load_decoder(out / "child").eval(), plan)
        log(f"Puzzle child: {goal:.3f}x in paired steps (tailor compress measured {report.measured_speedup}x)")
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
            name, model, measured, reached = matched(parent, candidates, builder, goal, plan)
            seconds = {"search": time.monotonic() - started}
            label, folder = template.format(name), work / f"{kind}-{target}x"
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
            row = evaluate(label, child_dir, parent_lazy, texts, seconds)
            row.update(target=target, seed=base.seed, speedup=measured, reached_goal=reached)
            rows.append(row)
            log(f"{label}: " + ", ".join(f"{d} ppl {q['perplexity']:.2f} kl {q['kl']:.4f}"
                                         for d, q in row["domains"].items()) + f", {row['speedup']:.2f}x")
    parallel.finish()
    return rows


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarise(rows: list[dict[str, Any]], domains: list[str]) -> list[dict[str, Any]]:
    """Per target and model kind: speed-up, and perplexity and KL per domain, as mean and spread over the runs;
    for Puzzle, also how much lower its KL is than the best baseline's, per domain (from the means)."""
    summary: list[dict[str, Any]] = []
    for target in sorted({row["target"] for row in rows}, reverse=True):
        kinds: dict[str, dict[str, Any]] = {}
        for kind in ("puzzle", "drop", "uniform"):
            mine = [row for row in rows if row["target"] == target and row["kind"] == kind]
            kinds[kind] = {"target": target, "kind": kind, "runs": len(mine),
                           "speedup": spread([row["speedup"] for row in mine]),
                           "reached_goal": all(row["reached_goal"] for row in mine),
                           **{domain: {metric: spread([row["domains"][domain][metric] for row in mine])
                                       for metric in ("perplexity", "kl")} for domain in domains}}
        kinds["puzzle"]["kl_below_best_baseline"] = {
            domain: 1 - kinds["puzzle"][domain]["kl"]["mean"] / min(kinds[k][domain]["kl"]["mean"]
                                                                    for k in ("drop", "uniform"))
            for domain in domains}
        summary.extend(kinds.values())
    return summary


def with_settings(plan: Plan, settings: list[str]) -> Plan:
    """`plan` with FIELD=VALUE settings: FIELD a dotted path as the plan file spells it (`data.seqLen`), VALUE
    read as YAML."""
    data = plan.model_dump(mode="json", by_alias=True)
    for setting in settings:
        path, _, value = setting.partition("=")
        *parents, leaf = path.split(".")
        node: Any = data
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            raise SystemExit(f"--set {setting}: the plan has no field {path!r}")
        node[leaf] = yaml.safe_load(value)
    try:
        return Plan.model_validate(data)
    except ValidationError as error:
        raise SystemExit(f"--set {' '.join(settings)}: {problems(error)}") from error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", type=Path, default=ROOT / "examples" / "plans" / "smollm2-cpu.yaml")
    parser.add_argument("--targets", type=float, nargs="+", default=[1.5])
    parser.add_argument("--runs", type=int, default=3, help="runs, seeds plan.seed, plan.seed + 1, ...")
    parser.add_argument("--out-of-domain", nargs="+", default=["news", "python-docs"],
                        help="texts no stage reads: built-in corpora, folders or files")
    parser.add_argument("--set", dest="settings", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="change the plan's fields, e.g. rounds=2 data.seqLen=512")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "bench-puzzle")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "puzzle.json")
    args = parser.parse_args()
    base = with_settings(Plan.load(args.plan), args.settings)
    parent_dir = resolve_parent(base.parent)
    tokenizer = AutoTokenizer.from_pretrained(parent_dir)
    other = {name: token_windows(documents(text_files(name)), tokenizer, base.data.seq_len, base.eval_tokens)
             for name in args.out_of_domain}
    domains = [IN_DOMAIN, *other]
    parent = LazyDecoder(parent_dir)
    in_domain = load_splits(base, tokenizer, args.work / "tokens").evaluation
    parent_quality = {domain: quality(parent, parent, ids).perplexity
                      for domain, ids in {IN_DOMAIN: in_domain, **other}.items()}
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    for number in range(args.runs):
        plan = base.model_copy(update={"seed": base.seed + number})
        rows += run(plan, parent_dir, args.targets, args.work / f"run-{number}",
                    lambda splits: {IN_DOMAIN: splits.evaluation, **other})
        result = {"plan": str(args.plan), "settings": args.settings, "text": base.data.text, "device": "cpu",
                  "threads": torch.get_num_threads(),
                  "parent": {"params": parent.arch.total_params, "perplexity": parent_quality},
                  "domains": domains, "runs": number + 1, "gkd_tokens": base.gkd.tokens,
                  "bld_tokens_per_variant": base.bld.tokens, "rows": rows, "summary": summarise(rows, domains)}
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(result, indent=2) + "\n")  # after every run: a stopped run keeps them
    print(f"parent ({parent.arch.total_params:,} params): ppl " +
          ", ".join(f"{d} {v:.2f}" for d, v in parent_quality.items()))
    print(f"{'target':>6} {'model':<8} {'speed-up':>15} " +
          " ".join(f"{d + ' KL':>22} {d + ' ppl':>22}" for d in domains))
    for entry in result["summary"]:
        cells = " ".join(f"{_cell(entry[d]['kl'], 3):>22} {_cell(entry[d]['perplexity'], 1):>22}" for d in domains)
        print(f"{entry['target']:>6} {entry['kind']:<8} {_cell(entry['speedup'], 2):>15} {cells}")
        if "kl_below_best_baseline" in entry:
            print(f"{'':>6} Puzzle's KL below the best baseline's: " +
                  ", ".join(f"{d} {v:+.0%}" for d, v in entry["kl_below_best_baseline"].items()))
    plot(result, args.results.with_suffix(".png"))
    return 0


def _cell(values: dict[str, float], digits: int) -> str:
    return f"{values['mean']:.{digits}f} ± {values['stdev']:.{digits}f}"


def plot(result: dict[str, Any], path: Path) -> None:
    """KL to the parent per domain: each model kind's mean over the runs (bars) and each run (dots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains, targets = result["domains"], sorted({row["target"] for row in result["rows"]}, reverse=True)
    kinds = [("puzzle", "Puzzle"), ("drop", "layers dropped (Block Influence)"), ("uniform", "uniform FFN width")]
    figure, axes = plt.subplots(1, len(targets), figsize=(8 * len(targets), 4.5), squeeze=False)
    for ax, target in zip(axes[0], targets, strict=True):
        width = 0.8 / len(kinds)
        for k, (kind, label) in enumerate(kinds):
            mine = [row for row in result["rows"] if row["target"] == target and row["kind"] == kind]
            speedups = [row["speedup"] for row in mine]
            for d, domain in enumerate(domains):
                kls = [row["domains"][domain]["kl"] for row in mine]
                x = d + (k - 1) * width
                ax.bar(x, statistics.fmean(kls), width, color=f"C{k}",
                       label=f"{label} ({statistics.fmean(speedups):.2f}x)" if d == 0 else None)
                ax.scatter([x] * len(kls), kls, color="black", s=8, zorder=3)
        ax.set_xticks(range(len(domains)), domains)
        ax.set_ylabel("KL to the parent (lower is better)")
        ax.set_title(f"SmolLM2-135M at {target}x: {result['runs']} runs, same GKD budget, matched measured speed")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
