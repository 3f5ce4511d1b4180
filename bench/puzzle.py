"""Puzzle vs width pruning in the Minitron style vs dropping layers, at matched measured decode speed, on
SmolLM2-135M, scored on a development set and on a test set of other genres, over several runs.

Each run (its own seed) and throughput target: run `tailor compress` (a second target reuses the run's BLD and
scores), then build both baselines from the parent at the Puzzle child's measured speed (`baselines.py`):
- width pruning (Minitron): every layer keeps the same query heads per KV group and FFN width, the most important
  by activation; the candidates, least pruned first, are every heads-per-group and FFN width (in steps of 64);
- layer drop: whole layers removed in order of least Block Influence (ShortGPT), the fewest that reach the speed.
A baseline is the first candidate whose speed-up comes within SPEED_MATCH of the Puzzle child's, from below or
above; one that cannot is reported as not matched. Both then get the Puzzle child's GKD token budget.

Every speed-up is measured in one harness, in this process, as `tailor compress` checks its child: paired decode
steps, the model's beside the parent's, SPEED_ROUNDS pairs (`calibration.speedup_pairs`), reported as their
median and range, so a machine that slows down during a run slows both sides of every pair. The Puzzle child's
median is compared with the figure `tailor compress` measured for it (its closed loop's tolerance,
`calibration.SPEED_TOLERANCE`).

Scored on the same text, `--domain-tokens` per domain: the plan's held-out documents (in-domain), the development
set (news and Python's reference documentation: texts earlier runs were tuned against) and the test set
(`sources.py`: Wikipedia articles, film reviews, the standard library's code), fixed on 2026-12-05 before any run
scored it. The summary gives each model's mean and spread over the runs, and Puzzle's KL below the best
baseline's on each set (mean over its domains).

    .venv/bin/python bench/puzzle.py   # 3 runs at 1.5x and 2x, ~75 min each on 2 cores: bench/results/puzzle-test-set.*
    .venv/bin/python bench/puzzle.py --runs 1 --set rounds=2 --results build/puzzle-rounds2.json   # a plan variant
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from baselines import block_influence, drop_layers, minitron, minitron_importance, save_minitron
from pydantic import ValidationError
from transformers import AutoTokenizer

from tailor.compressor.architecture import Attention, Mlp
from tailor.compressor.checkpoint import load_decoder, save_decoder
from tailor.compressor.costs import Phase, Workload
from tailor.compressor.lazy import LazyDecoder
from tailor.compressor.modeling import Decoder
from tailor.compressor.puzzle import gkd, parallel
from tailor.compressor.puzzle.calibration import SPEED_TOLERANCE, speedup_pairs
from tailor.compressor.puzzle.data import documents, load_splits, text_files, token_windows
from tailor.compressor.puzzle.evaluate import quality
from tailor.compressor.puzzle.pipeline import resolve_parent
from tailor.compressor.puzzle.plan import Plan, problems

ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


SPEED_MATCH = 0.03  # a baseline's speed-up within 3% of the Puzzle child's, either way
SPEED_ROUNDS = 7  # paired timings per speed-up
DEVELOPMENT = ["news", "python-docs"]  # texts earlier runs were tuned against
TEST = ["wikipedia", "movie-reviews", "python-code"]  # fixed on 2026-12-05, before any run scored them


def speed(parent: Decoder, model: Decoder, plan: Plan) -> dict[str, float]:
    """`model`'s decode speed-up over `parent` at the plan's batch and context: median and range of paired
    steps."""
    work = Workload(phase=Phase.DECODE, batch=plan.target.batch, context=plan.target.context)
    pairs = speedup_pairs(parent, model, work, SPEED_ROUNDS)
    return {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs)}


def matched(parent: Decoder, candidates: list[tuple[str, Any]], build: Any, goal: float,
            plan: Plan) -> tuple[str, Decoder, dict[str, float], bool]:
    """The first candidate (least compressed first) whose measured speed-up comes within SPEED_MATCH of `goal`
    (True), else the first past it or the last one (False)."""
    model, measured = None, {"median": 0.0}
    for name, knob in candidates:
        model = build(knob)
        measured = speed(parent, model, plan)
        within = abs(measured["median"] / goal - 1) <= SPEED_MATCH
        log(f"  {name}: {measured['median']:.3f}x ({measured['min']:.3f}-{measured['max']:.3f}; goal {goal:.3f}x"
            f"{', matched' if within else ''})")
        if within or measured["median"] > goal:
            return name, model, measured, within
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


def run(base: Plan, parent_dir: Path, targets: list[float], work: Path, texts_of: Any,
        done: Callable[[list[dict[str, Any]]], None]) -> None:
    """One run: for each target, Puzzle and both baselines at its measured speed, each scored on every text;
    `done` gets each target's rows as soon as they are scored."""
    parallel.init(torch.device("cpu"))  # GKD needs a process group (one process here)
    parent = load_decoder(parent_dir).eval()
    parent_lazy = LazyDecoder(parent_dir)
    splits = load_splits(base, AutoTokenizer.from_pretrained(parent_dir), work / "tokens")
    texts = texts_of(splits)
    calibration = splits.train[:-(-base.bld_activation_tokens // base.data.seq_len)].long()
    influence = block_influence(parent, calibration[:16])
    drop_order = sorted(range(len(influence)), key=lambda i: influence[i])
    importance = minitron_importance(parent, calibration, base.bld.batch)
    attention, ffn = parent.arch.blocks[0].mixer, parent.arch.blocks[0].ffn
    assert isinstance(attention, Attention) and isinstance(ffn, Mlp)
    group = attention.num_heads // attention.num_kv_heads
    # every heads-per-group and FFN width, the most parameters first (per layer and hidden channel)
    widths = sorted(((m, w) for m in range(group, 0, -1) for w in range(ffn.intermediate_size, 63, -64)),
                    key=lambda mw: -(2 * attention.num_kv_heads * mw[0] * attention.head_dim + 3 * mw[1]))
    from tailor.compressor.puzzle.pipeline import compress

    first_out: Path | None = None
    for target in targets:
        rows: list[dict[str, Any]] = []
        plan = base.model_copy(update={"target": base.target.model_copy(update={"throughput": target})})
        out = work / f"puzzle-{target}x"
        if first_out is not None and not out.exists():
            shutil.copytree(first_out / "stages", out / "stages")  # same library: reuse BLD and scores
        log(f"Puzzle at {target}x (seed {base.seed})")
        report = compress(plan, out)
        assert report is not None
        first_out = first_out or out
        goal = speed(parent, load_decoder(out / "child").eval(), plan)
        own = report.measured_speedup
        agrees = own is not None and abs(own / goal["median"] - 1) <= SPEED_TOLERANCE
        log(f"Puzzle child: {goal['median']:.3f}x ({goal['min']:.3f}-{goal['max']:.3f}) in paired steps; tailor "
            f"compress measured {own}x ({'within' if agrees else 'outside'} its {SPEED_TOLERANCE:.0%} tolerance)")
        puzzle_seconds = {k: v for k, v in report.stage_seconds.items() if k.startswith("round")}
        models = [("puzzle", out / "child", goal, True, puzzle_seconds)]
        baselines = [
            ("minitron", "minitron {}", [(f"{m} heads/group, ffn {w}", (m, w)) for m, w in widths],
             lambda mw: minitron(parent, importance, *mw), lambda model, folder: save_minitron(model, folder,
                                                                                             parent_dir)),
            ("drop", "{} (block influence)", [(f"drop {k} layers", k) for k in range(1, len(drop_order))],
             lambda k: drop_layers(parent, set(drop_order[:k])),
             lambda model, folder: save_decoder(model, folder, parent_dir))]
        for kind, template, candidates, builder, save in baselines:
            started = time.monotonic()
            name, model, measured, within = matched(parent, candidates, builder, goal["median"], plan)
            seconds = {"search": time.monotonic() - started}
            label, folder = template.format(name), work / f"{kind}-{target}x"
            save(model, folder / "assembled")
            del model
            log(f"GKD for {label}")
            began = time.monotonic()
            parallel.init(torch.device("cpu"))  # compress() closes its process group when it returns
            gkd.distill(folder / "assembled", folder / "child", parent_lazy, parent_dir, splits.train, plan.gkd,
                        plan.seed, log)
            seconds["gkd"] = time.monotonic() - began
            models.append((label, folder / "child", measured, within, seconds))
        for label, child_dir, measured, within, seconds in models:
            row = evaluate(label, child_dir, parent_lazy, texts, seconds)
            row.update(target=target, seed=base.seed, speedup=measured["median"],
                       speedup_range=[measured["min"], measured["max"]], speed_matched=within)
            if row["kind"] == "puzzle":
                row.update(compress_speedup=own, compress_speedup_agrees=agrees)
            rows.append(row)
            log(f"{label}: " + ", ".join(f"{d} kl {q['kl']:.4f}" for d, q in row["domains"].items())
                + f", {row['speedup']:.2f}x")
        done(rows)
    parallel.finish()


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}


KINDS = ("puzzle", "minitron", "drop")
NGRAM = 8


def ngrams(text: str) -> set[int]:
    words = text.lower().split()
    return {hash(tuple(words[i:i + NGRAM])) for i in range(len(words) - NGRAM + 1)}


def overlap(names: list[str], training: str) -> dict[str, float]:
    """The share of each text's word 8-grams that the training corpus holds too: near 0 for text it never saw."""
    seen: set[int] = set()
    for document in documents(text_files(training)):
        seen |= ngrams(document.text())
    shares = {}
    for name in names:
        mine = set().union(*(ngrams(document.text()) for document in documents(text_files(name))))
        shares[name] = len(mine & seen) / max(1, len(mine))
    return shares




def summarise(rows: list[dict[str, Any]], sets: dict[str, list[str]]) -> list[dict[str, Any]]:
    """Per target and model kind: speed-up, and perplexity and KL per domain, as mean and spread over the runs;
    for Puzzle, also how much lower its KL is than the best baseline's on each set of domains (the mean of the
    set's domain means)."""
    domains = [domain for names in sets.values() for domain in names]
    summary: list[dict[str, Any]] = []
    for target in sorted({row["target"] for row in rows}, reverse=True):
        kinds: dict[str, dict[str, Any]] = {}
        for kind in KINDS:
            mine = [row for row in rows if row["target"] == target and row["kind"] == kind]
            kinds[kind] = {"target": target, "kind": kind, "runs": len(mine),
                           "speedup": spread([row["speedup"] for row in mine]),
                           "speed_matched": all(row["speed_matched"] for row in mine),
                           **{domain: {metric: spread([row["domains"][domain][metric] for row in mine])
                                       for metric in ("perplexity", "kl")} for domain in domains}}

        kl = {kind: {label: statistics.fmean(kinds[kind][domain]["kl"]["mean"] for domain in names)
                     for label, names in sets.items()} for kind in KINDS}
        kinds["puzzle"]["kl_below_best_baseline"] = {
            label: 1 - kl["puzzle"][label] / min(kl[kind][label] for kind in KINDS[1:]) for label in sets}
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
    parser.add_argument("--targets", type=float, nargs="+", default=[1.5, 2.0])
    parser.add_argument("--runs", type=int, default=3, help="runs, seeds plan.seed, plan.seed + 1, ...")
    parser.add_argument("--development", nargs="+", default=DEVELOPMENT,
                        help="texts no stage reads, tuned against: built-in corpora, folders or files")
    parser.add_argument("--test", nargs="+", default=TEST, help="texts no stage reads, never tuned against")
    parser.add_argument("--domain-tokens", type=int, default=8192, help="tokens scored per development or test text")
    parser.add_argument("--set", dest="settings", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="change the plan's fields, e.g. rounds=2 data.seqLen=512")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "bench-puzzle")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "puzzle-test-set.json")
    args = parser.parse_args()
    base = with_settings(Plan.load(args.plan), args.settings)
    parent_dir = resolve_parent(base.parent)
    tokenizer = AutoTokenizer.from_pretrained(parent_dir)
    sets = {IN_DOMAIN: [IN_DOMAIN], "development": args.development, "test": args.test}
    other = {name: token_windows(documents(text_files(name)), tokenizer, base.data.seq_len, args.domain_tokens)
             for name in [*args.development, *args.test]}
    domains = [IN_DOMAIN, *other]
    shared = overlap([*args.development, *args.test], base.data.text)
    log("word 8-grams also in the training corpus: " + ", ".join(f"{n} {v:.2%}" for n, v in shared.items()))
    parent = LazyDecoder(parent_dir)
    in_domain = load_splits(base, tokenizer, args.work / "tokens").evaluation
    parent_quality = {domain: quality(parent, parent, ids).perplexity
                      for domain, ids in {IN_DOMAIN: in_domain, **other}.items()}
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {}

    def save(scored: list[dict[str, Any]]) -> None:
        """Written after every target of every run: a stopped run keeps what it scored."""
        nonlocal result
        rows.extend(scored)
        result = {"plan": str(args.plan), "settings": args.settings, "text": base.data.text, "device": "cpu",
                  "threads": torch.get_num_threads(), "sets": sets, "ngrams_in_training_corpus": shared,
                  "tokens_scored": {domain: ids.numel() for domain, ids in {IN_DOMAIN: in_domain, **other}.items()},
                  "parent": {"params": parent.arch.total_params, "perplexity": parent_quality},
                  "domains": domains, "runs": len({row["seed"] for row in rows}), "gkd_tokens": base.gkd.tokens,
                  "bld_tokens_per_variant": base.bld.tokens, "rows": rows, "summary": summarise(rows, sets)}
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(result, indent=2) + "\n")

    for number in range(args.runs):
        plan = base.model_copy(update={"seed": base.seed + number})
        run(plan, parent_dir, args.targets, args.work / f"run-{number}",
            lambda splits: {IN_DOMAIN: splits.evaluation, **other}, save)
    print(f"parent ({parent.arch.total_params:,} params): ppl " +
          ", ".join(f"{d} {v:.2f}" for d, v in parent_quality.items()))
    print(f"{'target':>6} {'model':<9} {'speed-up':>13} " + " ".join(f"{d + ' KL':>20}" for d in domains))
    for entry in result["summary"]:
        cells = " ".join(f"{_cell(entry[d]['kl'], 3):>20}" for d in domains)
        print(f"{entry['target']:>6} {entry['kind']:<9} {_cell(entry['speedup'], 2):>13} {cells}")
        if "kl_below_best_baseline" in entry:
            print(f"{'':>6} Puzzle's KL below the best baseline's: " +
                  ", ".join(f"{label} {v:+.0%}" for label, v in entry["kl_below_best_baseline"].items()))
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
    kinds = [("puzzle", "Puzzle"), ("minitron", "width pruned (Minitron)"),
             ("drop", "layers dropped (Block Influence)")]
    figure, axes = plt.subplots(1, len(targets), figsize=(8 * len(targets), 4.5), squeeze=False)
    for ax, target in zip(axes[0], targets, strict=True):
        width = 0.8 / len(kinds)
        for k, (kind, label) in enumerate(kinds):
            mine = [row for row in result["rows"] if row["target"] == target and row["kind"] == kind]
            speedups = [row["speedup"] for row in mine]
            for d, domain in enumerate(domains):
                kls = [row["domains"][domain]["kl"] for row in mine]
                x = d + (k - 1) * width
                matched = "" if kind == "puzzle" or all(row["speed_matched"] for row in mine) else ", not matched"
                ax.bar(x, statistics.fmean(kls), width, color=f"C{k}",
                       label=f"{label} ({statistics.fmean(speedups):.2f}x{matched})" if d == 0 else None)
                ax.scatter([x] * len(kls), kls, color="black", s=8, zorder=3)
        ax.set_xticks(range(len(domains)), [f"{d}\n(test)" if d in result["sets"]["test"] else d for d in domains],
                      fontsize=8)
        ax.set_ylabel("KL to the parent (lower is better)")
        ax.set_title(f"SmolLM2-135M at {target}x: {result['runs']} run(s), same GKD budget, baselines within "
                     f"{SPEED_MATCH:.0%} of Puzzle's measured speed unless marked")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
