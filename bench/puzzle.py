"""Puzzle vs width pruning in the Minitron style vs dropping sub-blocks, at matched measured decode speed, on
SmolLM2-135M, scored on a development set and on a test set of other genres, over several runs.

Each run (its own seed) and throughput target: run `tailor compress` (a second target reuses the run's BLD and
scores), then build both baselines from the parent at the Puzzle child's measured speed (`baselines.py`):
- width pruning (Minitron): every layer keeps the same query heads per KV group and FFN width, and the model
  fewer embedding channels, the most important by activation; the candidates are every shape on that grid, the
  most parameters first;
- block drop: attention and FFN sub-blocks removed in order of least Block Influence (ShortGPT's measure, per
  sub-block), the candidates one more sub-block at a time.
The candidates are bisected on measured speed-up for the first to come within SPEED_MATCH of the Puzzle child's,
and a few either side of it measured too; of those within SPEED_MATCH, the one of least KL to the parent on
calibration text before distillation is the baseline. One that no candidate matches is reported as not matched.
Both then get the Puzzle child's GKD token budget (a child with fewer embedding channels learns from the logits
alone: its layer states cannot be compared with the parent's).

Every speed-up is measured in one harness, in this process, as `tailor compress` checks its child: paired decode
steps, the model's beside the parent's, SPEED_ROUNDS pairs (`calibration.measured_speedup`), reported as their
median and range, so a machine that slows down during a run slows both sides of every pair. The Puzzle child's
median is compared with the figure `tailor compress` measured for it (its closed loop's tolerance,
`calibration.SPEED_TOLERANCE`).

Scored on the same text, `--domain-tokens` per domain: the plan's held-out documents (in-domain), the development
set (news and Python's reference documentation: texts earlier runs were tuned against) and the test set
(`sources.py`: Wikipedia articles, film reviews, the standard library's code), fixed on 2026-12-05 before any run
scored it. The summary gives each model's mean and spread over the runs, and Puzzle's KL below the best
baseline's on each set (mean over its domains).

    .venv/bin/python bench/puzzle.py   # 3 runs at 1.5x and 2x, ~1 h each, 2 cores: bench/results/puzzle-test-set.*
    .venv/bin/python bench/puzzle.py --resume   # keep the finished seeds and targets, run the rest
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
from typing import Any, NamedTuple

import torch
from baselines import block_influence, drop_slots, minitron, minitron_importance, minitron_shapes, save_minitron
from transformers import AutoTokenizer

from tailor.compressor.model.checkpoint import load_decoder, save_decoder
from tailor.compressor.model.device import compute_for, torch_dtype
from tailor.compressor.model.lazy import LazyDecoder
from tailor.compressor.model.modeling import Decoder
from tailor.compressor.puzzle import gkd, parallel
from tailor.compressor.puzzle.calibration import SPEED_TOLERANCE, measured_speedup
from tailor.compressor.puzzle.data import load_splits
from tailor.compressor.puzzle.evaluate import qualities, quality
from tailor.compressor.puzzle.pipeline import resolve_parent
from tailor.compressor.puzzle.plan import Plan, PlanError
from tailor.compressor.sizing.costs import Phase, Workload
from tailor.compressor.text import documents, text_files, token_windows

ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


SPEED_MATCH = 0.03  # a baseline's speed-up within 3% of the Puzzle child's, either way
SPEED_ROUNDS = 7  # paired timings per speed-up
NEIGHBOURS = {"minitron": 2, "drop": 1}  # candidates measured either side of the bisection's pick
DEVELOPMENT = ["news", "python-docs"]  # texts earlier runs were tuned against
TEST = ["wikipedia", "movie-reviews", "python-code"]  # fixed on 2026-12-05, before any run scored them


def speed(parent: Decoder, model: Decoder, plan: Plan) -> dict[str, float]:
    """`model`'s decode speed-up over `parent` at the plan's batch and context: median and range of paired
    steps."""
    work = Workload(phase=Phase.DECODE, batch=plan.target.batch, context=plan.target.context)
    dtype = torch_dtype(compute_for(torch.device("cpu"), plan.compute_dtype))  # as compress times its child
    paired = measured_speedup(parent, model, work, dtype, SPEED_ROUNDS)
    return {"median": paired.median, "min": paired.low, "max": paired.high}


def matched(parent: Decoder, candidates: list[tuple[str, Any]], build: Callable[[Any], Decoder], goal: float,
            plan: Plan, calibration: torch.Tensor, neighbours: int) -> tuple[int, dict[int, dict[str, Any]], bool]:
    """Bisect `candidates` (least compressed first: speed-up rising with the index, give or take noise) for the
    first whose measured speed-up comes within SPEED_MATCH of `goal`, then measure `neighbours` either side of it.
    Of the measured candidates within SPEED_MATCH, the one of least KL to the parent on calibration text before
    distillation is chosen (True); if none is, the one nearest the goal (False). Returns the chosen index and
    every measured candidate's speed-up (and KL, where it was compared)."""
    measured: dict[int, dict[str, Any]] = {}

    def measure(index: int) -> float:
        if index not in measured:
            figures = speed(parent, build(candidates[index][1]), plan)
            measured[index] = {"name": candidates[index][0], "speedup": figures}
            within = abs(figures["median"] / goal - 1) <= SPEED_MATCH
            log(f"  {candidates[index][0]}: {figures['median']:.3f}x ({figures['min']:.3f}-{figures['max']:.3f}; goal "
                f"{goal:.3f}x{', within' if within else ''})")
        return float(measured[index]["speedup"]["median"])

    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if measure(middle) < goal * (1 - SPEED_MATCH) else (low, middle)
    for index in range(max(0, low - neighbours), min(len(candidates), low + neighbours + 1)):
        measure(index)
    within = [i for i, m in measured.items() if abs(m["speedup"]["median"] / goal - 1) <= SPEED_MATCH]
    if not within:
        return min(measured, key=lambda i: abs(measured[i]["speedup"]["median"] / goal - 1)), measured, False
    for index in within:
        measured[index]["calibration_kl"] = quality(build(candidates[index][1]), parent, calibration).kl
        log(f"  {candidates[index][0]}: KL {measured[index]['calibration_kl']:.4f} on calibration text, undistilled")
    return min(within, key=lambda i: measured[i]["calibration_kl"]), measured, True


IN_DOMAIN = "in-domain"


class Baseline(NamedTuple):
    """A baseline's candidates (least compressed first), how many either side of the bisection's pick are
    measured too, how a candidate's knob builds its model and how the model is saved."""

    kind: str
    template: str  # its label, from the chosen candidate's name
    candidates: list[tuple[str, Any]]
    neighbours: int
    build: Callable[[Any], Decoder]
    save: Callable[[Decoder, Path], None]


def evaluate(children: dict[str, Path], parent: LazyDecoder,
             texts: dict[str, torch.Tensor]) -> dict[str, dict[str, dict[str, float]]]:
    """Each child's perplexity and KL to the parent on each text (the in-domain held-out split and every other
    domain), the parent's logits computed once per text for all of them."""
    models = {"parent": parent, **{label: LazyDecoder(folder) for label, folder in children.items()}}
    pairs = [(label, "parent") for label in children]
    scores = {domain: qualities(models, pairs, ids) for domain, ids in texts.items()}
    return {label: {domain: {"perplexity": scores[domain][(label, "parent")].perplexity,
                             "kl": scores[domain][(label, "parent")].kl} for domain in texts} for label in children}


def run(base: Plan, parent_dir: Path, targets: list[float], work: Path, texts_of: Any,
        done: Callable[[list[dict[str, Any]]], None]) -> None:
    """One run: for each of `targets`, Puzzle and both baselines at its measured speed, each scored on every text;
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
    shapes = minitron_shapes(parent)
    slots = parent.slots()

    def dropped(k: int) -> str:
        attention = sum(slots[i].kind == "mixer" for i in drop_order[:k])
        return f"drop {k} sub-blocks ({attention} attention, {k - attention} FFN)"

    baselines = [
        Baseline("minitron", "minitron {}", [(str(shape), shape) for shape in shapes], NEIGHBOURS["minitron"],
                 lambda shape: minitron(parent, importance, shape),
                 lambda model, folder: save_minitron(model, folder, parent_dir)),
        Baseline("drop", "{} (block influence)", [(dropped(k), k) for k in range(1, len(drop_order))],
                 NEIGHBOURS["drop"],
                 lambda k: drop_slots(parent, set(drop_order[:k])),
                 lambda model, folder: save_decoder(model, folder, parent_dir))]
    from tailor.compressor.puzzle.pipeline import compress

    # a finished Puzzle run of this seed (another target, maybe of an earlier invocation) has the same library
    first_out = next((out for out in sorted(work.glob("puzzle-*x")) if (out / "report.json").exists()), None)
    for target in targets:
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
        rows = {"puzzle": {"kind": "puzzle", "speedup": goal, "speed_matched": True, "compress_speedup": own,
                           "compress_speedup_agrees": agrees,
                           "stage_seconds": {k: v for k, v in report.stage_seconds.items() if k.startswith("round")}}}
        children = {"puzzle": out / "child"}
        for kind, template, candidates, neighbours, builder, save in baselines:
            started = time.monotonic()
            log(f"{kind}: searching {len(candidates)} candidates for {goal['median']:.3f}x")
            index, searched, within = matched(parent, candidates, builder, goal["median"], plan,
                                              calibration[:16], neighbours)
            seconds = {"search": time.monotonic() - started}
            label, folder = template.format(candidates[index][0]), work / f"{kind}-{target}x"
            save(builder(candidates[index][1]), folder / "assembled")
            log(f"GKD for {label}")
            began = time.monotonic()
            parallel.init(torch.device("cpu"))  # compress() closes its process group when it returns
            gkd.distill(folder / "assembled", folder / "child", parent_lazy, parent_dir, splits.train, plan.gkd,
                        plan.seed, log)
            seconds["gkd"] = time.monotonic() - began
            children[label] = folder / "child"
            rows[label] = {"kind": kind, "speedup": searched[index]["speedup"], "speed_matched": within,
                           "candidates_measured": [searched[i] for i in sorted(searched)], "stage_seconds": seconds}
        log(f"scoring {', '.join(children)} on {', '.join(texts)}")
        scores = evaluate(children, parent_lazy, texts)
        scored = []
        for label, row in rows.items():
            model = LazyDecoder(children[label]).arch
            figures = row.pop("speedup")
            row.update(name=label, target=target, seed=base.seed, params=model.total_params, pattern=model.pattern,
                       speedup=figures["median"], speedup_range=[figures["min"], figures["max"]],
                       domains=scores[label])
            scored.append(row)
            log(f"{label}: " + ", ".join(f"{d} kl {q['kl']:.4f}" for d, q in row["domains"].items())
                + f", {row['speedup']:.2f}x")
        done(scored)
    parallel.finish()


def kept(results: Path, plan: str, settings: list[str]) -> list[dict[str, Any]]:
    """The rows of an earlier run of this bench with the same plan and settings (none if there is none)."""
    if not results.exists():
        return []
    earlier = json.loads(results.read_text())
    if (earlier["plan"], earlier["settings"]) != (plan, settings):
        raise SystemExit(f"--resume: {results} holds {earlier['plan']} with {earlier['settings']}, not {plan} with "
                         f"{settings}")
    log(f"resuming: {len(earlier['rows'])} rows from {results}")
    return list(earlier["rows"])


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
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows --results holds (same plan and settings) and run only the seeds and "
                             "targets it lacks")
    args = parser.parse_args()
    try:
        base = Plan.load(args.plan).with_settings(args.settings)
    except PlanError as error:
        raise SystemExit(str(error)) from error
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
    rows = kept(args.results, str(args.plan), args.settings) if args.resume else []
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
        targets = [t for t in args.targets if {row["kind"] for row in rows
                                                if (row["seed"], row["target"]) == (plan.seed, t)} != set(KINDS)]
        if targets:
            run(plan, parent_dir, targets, args.work / f"run-{number}",
                lambda splits: {IN_DOMAIN: splits.evaluation, **other}, save)
        else:
            save([])
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
             ("drop", "sub-blocks dropped (Block Influence)")]
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
        ax.set_title(f"SmolLM2-135M at {target}x, {result['runs']} run(s)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    figure.suptitle(f"KL to the parent: the same GKD budget for all; baselines within {SPEED_MATCH:.0%} of Puzzle's "
                    "measured speed-up unless marked", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
