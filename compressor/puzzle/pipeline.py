"""`tailor compress`: the Puzzle pipeline, stage by stage, resumable from what each stage saved.

    out/stages/manifest.json          fingerprints: parent + library settings (must match to resume), target
    out/stages/round{r}/library.json  1. variants per slot
    out/stages/round{r}/activations/  2a. the residual stream entering every slot (BLD and scoring rows)
    out/stages/round{r}/bld/          2. one safetensors file per trained variant
    out/stages/round{r}/scores.json   3. replace-1-block KL and LM loss per variant
    out/stages/round{r}/costs.json    4. cost of every variant on the target
    out/stages/round{r}/search.json   5. the MIP's solutions
    out/stages/round{r}/assembled/    6. the assembled child
    out/stages/round{r}/gkd-checkpoint/  7a. GKD's sharded training state (torch.distributed.checkpoint), while it runs
    out/stages/round{r}/child/        7. the child after GKD (input of round r+1)
    out/child/, out/pareto.{json,png}, out/report.{json,md}   written last; report.json marks a finished run

No stage holds a whole model unless it fits `budgetGiB`: models are read layer by layer from their files
(`lazy.LazyDecoder`). Under torchrun, BLD and scoring split the slots across the ranks and GKD shards the
child across them (FSDP2); rank 0 captures activations, searches, assembles and evaluates, streaming.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tailor.compressor import peaks, sources, tiny_hybrid
from tailor.compressor.compute import Compute
from tailor.compressor.files import staged_folder, write_json, write_text
from tailor.compressor.model.architecture import Architecture
from tailor.compressor.model.checkpoint import CheckpointError, read_config
from tailor.compressor.model.device import compute_for, torch_dtype
from tailor.compressor.model.lazy import LazyDecoder
from tailor.compressor.model.modeling import Decoder
from tailor.compressor.puzzle import activations, gkd, parallel
from tailor.compressor.puzzle.assembly import assemble
from tailor.compressor.puzzle.bld import run_bld
from tailor.compressor.puzzle.calibration import (
    RESOLVES,
    SPEED_TOLERANCE,
    SpeedCheckError,
    calibrate,
    measured_speedup,
    speed_miss,
)
from tailor.compressor.puzzle.data import Splits, load_splits
from tailor.compressor.puzzle.evaluate import Quality, decode_tokens_per_second, qualities
from tailor.compressor.puzzle.footprint import WHOLE_MODEL_BYTES, WORKING_SHARE
from tailor.compressor.puzzle.library import Variant, part_label, slot_variants
from tailor.compressor.puzzle.measure import MeasuredCosts
from tailor.compressor.puzzle.options import is_hybrid
from tailor.compressor.puzzle.plan import CostSource, Plan, Target
from tailor.compressor.puzzle.pricing import Price, Pricer, resolve_source
from tailor.compressor.puzzle.report import ModelFigures, Report, RoundSummary
from tailor.compressor.puzzle.resume import Checkpoints
from tailor.compressor.puzzle.scoring import Score, gather_scores, score_variants
from tailor.compressor.puzzle.search import Candidate, limits_for, pareto, solve
from tailor.compressor.sizing.memory import recipe_for, weight_bytes


class Log:
    """Stage logs on stderr with elapsed time and this rank's peak memory; seconds and peaks per stage."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, dict[str, int]] = {}

    def __call__(self, message: str) -> None:
        rank, world = parallel.rank_world()
        prefix = f"[{time.monotonic() - self.started:7.1f}s]" + (f" rank {rank}" if world > 1 else "")
        print(f"{prefix} {message}", file=sys.stderr, flush=True)

    def in_round(self, number: int) -> Callable[[str], None]:
        """This log for a round's steps: each line names its round (`round2.bld: 412/1536 ...`), so the end of
        the log says which round is running however many lines the round has written (the operator reads the
        last lines for a stage's progress)."""
        return lambda message: self(f"round{number}.{message}")

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        peaks.reset()
        start = peaks.read()  # what the stage starts with: the peak was just reset to it
        self(f"{name}: start ({peaks.describe(start)} held)")
        begin = time.monotonic()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - begin
        peak = peaks.read()
        self.peaks[name] = {**{k: max(v, self.peaks.get(name, {}).get(k, 0)) for k, v in peak.items()},
                            **{f"{k}_at_start": v for k, v in start.items()}}
        self(f"{name}: done in {time.monotonic() - begin:.1f}s, peak {peaks.describe(peak)}")

    def save_peaks(self, out: Path) -> None:
        """This rank's peak memory per stage: out/memory.rank{r}.json."""
        write_json(out / f"memory.rank{parallel.rank_world()[0]}.json", self.peaks)


def resolve_device(name: str) -> torch.device:
    """A plan's or job's `device`: auto is the GPU where there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_parent(name: str) -> Path:
    """A model folder, an hf:// model (downloaded once), or a built-in parent fetched (or trained) on first use."""
    if name == sources.PARENT_NAME:
        return sources.fetch_parent()
    if name in (tiny_hybrid.NAME, tiny_hybrid.DENSE_NAME):
        return tiny_hybrid.fetch_tiny_hybrid(dense=name == tiny_hybrid.DENSE_NAME)
    if name.startswith(sources.HUB_PREFIX):
        return sources.fetch_hub(name)
    if name.startswith("s3://"):
        raise ValueError(f"{name}: s3:// parents are not supported yet; stage the model on a claim (pvc://)")
    return Path(name)


LIBRARY_FIELDS = {"parent", "data", "library", "bld", "bld_activation_tokens", "activation_chunk_tokens",
                  "scoring_tokens", "compute_dtype", "seed"}


def fingerprints(plan: Plan, parent: Path) -> dict[str, str]:
    """What the saved stages depend on. `library`: the parent's config and weight files and the plan's
    parent, data, library, BLD and scoring fields (stages 1-3 of round 1). `target`: everything else."""
    base = hashlib.sha256(json.dumps(read_config(parent), sort_keys=True).encode())
    for weights in sorted(parent.glob("*.safetensors")):
        base.update(f"{weights.name}:{weights.stat().st_size}".encode())
    library = base.copy()
    library.update(plan.model_dump_json(include=LIBRARY_FIELDS).encode())
    operational = {"budget_gib", "checkpoint_minutes"}  # how to run, not what to make
    target = hashlib.sha256(plan.model_dump_json(exclude=LIBRARY_FIELDS | operational).encode())
    return {"library": library.hexdigest()[:16], "target": target.hexdigest()[:16]}


def _check_manifest(stages: Path, plan: Plan, parent: Path, log: Log) -> None:
    """Refuse stages made for another parent or library; drop the target-dependent ones if only the target
    changed (round 1's costs, search and child, and every later round), so a new target reuses BLD and scores."""
    manifest = stages / "manifest.json"
    expected = {**fingerprints(plan, parent), "parent": str(parent)}
    if manifest.exists():
        found = _read_json(manifest)
        if found.get("library") != expected["library"]:
            raise CheckpointError(f"{manifest}: these saved stages were made by a different parent or library, "
                                  f"data, BLD or scoring settings ({found.get('library')} != {expected['library']}); "
                                  "use a new --out or delete the folder")
        if found.get("target") != expected["target"] and parallel.is_main():
            log("the target, GKD or search settings changed: recomputing costs, search, assembly and GKD")
            for stale in ("costs.json", "search.json", "round.json"):
                (stages / "round1" / stale).unlink(missing_ok=True)
            for child in ("assembled", "child"):
                shutil.rmtree(stages / "round1" / child, ignore_errors=True)
            for later in stages.glob("round*"):
                if later.name != "round1":
                    shutil.rmtree(later)
    parallel.barrier()
    if parallel.is_main():
        write_json(manifest, expected)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: corrupt saved stage ({error}); delete it to recompute that stage") from error


def rank_budget(plan: Plan, device: torch.device) -> float | None:
    """Bytes a rank plans for: budgetGiB, else the GPU's memory; None (no limit) on a CPU without budgetGiB."""
    if plan.budget_gib is not None:
        return plan.budget_gib * 2**30
    return float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None


def fits(arch: Architecture, plan: Plan, device: torch.device) -> bool:
    """Whether a whole model may be loaded to time its decoding: its float32 weights, a float32 copy on the way
    to one in the compute dtype, and that one, within the rank's budget (`rank_budget`)."""
    budget = rank_budget(plan, device)
    return budget is None or WHOLE_MODEL_BYTES * arch.total_params < budget


def _figures(model: LazyDecoder, found: Quality, plan: Plan) -> ModelFigures:
    arch = model.arch
    target = plan.target
    speed = decode_tokens_per_second(model.load(), target.batch, min(target.context, plan.measure_context),
                                     plan.measure_tokens, model.dtype) if fits(arch, plan, model.device) else None
    return ModelFigures(
        params=arch.total_params, active_params=arch.active_param_count,
        weight_bytes=weight_bytes(arch, recipe_for(target.precision, arch)), pattern=arch.pattern,
        quality=found, decode_tokens_per_second=speed)


class Round:
    """One Puzzle round on the current model: library, BLD, scores, costs, search, assembly, GKD."""

    def __init__(self, plan: Plan, number: int, target: Target, folder: Path, log: Log) -> None:
        self.plan, self.number, self.target, self.folder, self.log = plan, number, target, folder, log

    def _stage(self, name: str) -> Any:
        return self.log.stage(f"round{self.number}.{name}")

    def library(self, current: LazyDecoder, parent: LazyDecoder) -> list[list[Variant]]:
        parent_parts = [slot.part for slot in parent.slots()]
        with self._stage("library"):
            hybrid = is_hybrid(parent.arch)
            variants = [slot_variants(slot, parent_parts[slot.index], self.plan.library, self.plan.engine, hybrid)
                        for slot in current.slots()]
            if parallel.is_main():
                write_json(self.folder / "library.json", [[v.label for v in options] for options in variants])
        return variants

    def scores(self, current: LazyDecoder, variants: list[list[Variant]], splits: Splits,
               budget: float | None) -> dict[str, Score]:
        path = self.folder / "scores.json"
        known = {k: Score.model_validate(v) for k, v in _read_json(path).items()} if path.exists() else {}
        with self._stage("scoring"):
            mine = score_variants(current, variants, self.folder / "bld", self.folder / "activations",
                                  splits.scoring, known, self.log.in_round(self.number),
                                  self._streams(current, splits, budget))
            return gather_scores(path, mine, known)

    @staticmethod
    def _streams(current: LazyDecoder, splits: Splits, budget: float | None) -> int:
        """Variant streams one scoring sweep may hold: WORKING_SHARE of the budget (all of them without one)."""
        if budget is None:
            return 10**6
        stream = splits.scoring.numel() * current.arch.hidden_size * current.dtype.itemsize
        return max(1, int(WORKING_SHARE * budget // stream))

    def costs(self, pricer: Pricer, variants: list[list[Variant]]) -> dict[str, Price]:
        path = self.folder / "costs.json"
        if path.exists():
            return {k: Price.model_validate(v) for k, v in _read_json(path).items()}
        with self._stage("costs"):
            prices = {f"{v.slot}:{v.label}": pricer.price(v.part, v.kind) for options in variants for v in options}
            write_json(path, {k: v.model_dump() for k, v in prices.items()})
        return prices

    def search(self, variants: list[list[Variant]], scores: dict[str, Score], prices: dict[str, Price],
               fixed: Price, parent_price: Price) -> tuple[list[Variant], dict[str, Any], list[list[Candidate]]]:
        candidates = [[Candidate(slot=v.slot, label=v.label, score=scores[f"{v.slot}:{v.label}"].kl, state=v.state,
                                 price=prices[f"{v.slot}:{v.label}"]) for v in options] for options in variants]
        with self._stage("search"):
            found = solve(candidates, fixed, self.target, limits_for(self.target, parent_price),
                          self.plan.solutions, self.plan.diversity)
            write_json(self.folder / "search.json", [s.model_dump() for s in found])
        best = found[0]
        chosen = [next(v for v in options if v.label == label) for options, label in zip(variants, best.labels,
                                                                                         strict=True)]
        summary = {"achieved": best.achieved, "score": best.score, "alternatives": [s.score for s in found[1:]],
                   "totals": best.totals}
        return chosen, summary, candidates

    def settle(self, current: LazyDecoder, parent: LazyDecoder, variants: list[list[Variant]],
               scores: dict[str, Score], pricer: Pricer, timer: MeasuredCosts | None,
               parent_dir: Path) -> tuple[dict[str, Any], list[list[Candidate]]]:
        """Price, search and assemble; with measured costs, time the assembled child against the parent and, when
        it misses the predicted speed-up by more than SPEED_TOLERANCE, re-measure everything and search again
        (at most RESOLVES times), then fail naming both figures."""
        if timer is not None:  # priced again on this run's calibration: from the checked cache, or timed now
            (self.folder / "costs.json").unlink(missing_ok=True)
        measuring = timer is not None and fits(parent.arch, self.plan, parent.device)
        whole = parent.load() if measuring else None
        for search in range(1, RESOLVES + 2):
            fixed, parent_price = pricer.fixed, _parent_price(pricer, parent)
            prices = self.costs(pricer, variants)
            chosen, summary, candidates = self.search(variants, scores, prices, fixed, parent_price)
            with self._stage("assembly"):
                assemble(current, chosen, self.folder / "bld", self.folder / "assembled", parent_dir)
            child_price = Price.total([fixed, *(prices[f"{v.slot}:{v.label}"] for v in chosen)])
            predicted = parent_price.decode_s / child_price.decode_s
            summary.update(predicted_speedup=predicted, measured_speedup=None, measured_speedup_range=None,
                           searches=search)
            if not measuring:
                return summary, candidates
            assert timer is not None and whole is not None
            with self._stage("speed-check"):
                child = LazyDecoder(self.folder / "assembled", parent.dtype, parent.device).load()
                measured = measured_speedup(whole, child, pricer.decode, parent.dtype)
                del child
            summary.update(measured_speedup=measured.median, measured_speedup_range=[measured.low, measured.high])
            self.log(f"round {self.number}: the assembled child measured {measured.describe()} the parent's decode "
                     f"speed, the search predicted {predicted:.3f}x")
            miss = speed_miss(predicted, measured.median)
            if miss <= SPEED_TOLERANCE:
                return summary, candidates
            if search > RESOLVES:
                raise SpeedCheckError(
                    f"round {self.number}: the child measured {measured.median:.3f}x the parent's decode speed, the "
                    f"search predicted {predicted:.3f}x (more than {SPEED_TOLERANCE:.0%} apart) after {search} "
                    "searches, each on costs timed again; the timings on this machine do not describe the models it "
                    "runs (run on a quiet machine, or set target.costs: roofline)")
            self.log(f"round {self.number}: {miss:.0%} off the prediction: timing every "
                     "variant and the parent again, then searching again")
            timer.remember({}, forget_the_rest=True)
            (self.folder / "costs.json").unlink(missing_ok=True)
            _calibrate(pricer, timer, parent, self.log, whole)
        raise AssertionError("unreachable")


def _calibrate(pricer: Pricer, timer: MeasuredCosts, parent: LazyDecoder, log: Log,
               whole: Decoder | None = None) -> None:
    """Calibrate the fixed decode cost and each block's share of a whole step on the parent (cached timings that
    disagree with it are dropped)."""
    found = calibrate(whole or parent.load(), timer, pricer.decode, log)
    pricer.calibrate_decode(found.fixed_s, found.per_block_s)


def _parent_price(pricer: Pricer, parent: LazyDecoder) -> Price:
    return Price.total([pricer.fixed, *(pricer.price(slot.part, slot.kind) for slot in parent.slots())])


def compress(plan: Plan, out: Path) -> Report | None:
    """Run (or resume) the whole pipeline into `out`; rank 0 writes the report and returns it, other ranks None."""
    device = resolve_device(plan.device)
    parallel.init(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU
    log = Log()
    torch.manual_seed(plan.seed)
    compute = compute_for(device, plan.compute_dtype)
    log(f"compute dtype {compute.describe()}")
    plan = plan.model_copy(update={"compute_dtype": compute.dtype})
    frozen = torch_dtype(compute)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what trains is float32: its matmuls on TF32 tensor cores
        torch.backends.cudnn.allow_tf32 = True
    parent_dir = resolve_parent(plan.parent) if parallel.is_main() else None
    parent_dir = Path(parallel.broadcast(str(parent_dir)))  # rank 0 fetches a built-in parent once
    stages = out / "stages"
    with log.stage("load"):
        parent = LazyDecoder(parent_dir, frozen, device)
        _check_manifest(stages, plan, parent_dir, log)
        plan = plan.model_copy(update={"target": plan.target.for_parent(parent.arch.total_params,
                                                                        parent.arch.active_param_count)})
        from transformers import AutoTokenizer

        splits = load_splits(plan, AutoTokenizer.from_pretrained(parent_dir), stages / "tokens")
        splits = Splits(splits.train, splits.scoring.to(device), splits.evaluation.to(device))
        log(f"data: {splits.describe()} tokens (train, scoring, evaluation)")
    source = resolve_source(plan.target, on_cpu=device.type == "cpu")
    # rank 0 alone prices and searches: the other ranks would time the same parts on the same host
    timer = MeasuredCosts(dev=device, dtype=frozen) if source is CostSource.MEASURED and parallel.is_main() else None
    pricer = Pricer(parent.arch, plan.target, timer)
    with log.stage("costs.parent"):
        if timer is not None and fits(parent.arch, plan, device):
            _calibrate(pricer, timer, parent, log)
        elif timer is not None:
            log("costs: the parent does not fit budgetGiB whole, so its decode step is not timed; the fixed cost is "
                "the LM head's, timed alone")
        parent_memory_gib = _parent_price(pricer, parent).memory_bytes(plan.target) / 2**30
    current, rounds = parent, []
    candidates: list[list[Candidate]] = []
    bld_rows = max(1, min(splits.train.shape[0], -(-plan.bld_activation_tokens // plan.data.seq_len)))
    for number, target in enumerate(plan.round_targets(parent_memory_gib), 1):
        folder = stages / f"round{number}"
        step = Round(plan, number, target, folder, log)
        finished = folder / "child"
        variants = step.library(current, parent)
        if (finished / "config.json").exists() and (folder / "round.json").exists():
            log(f"round {number}: resuming from {finished}")
            current = LazyDecoder(finished, frozen, device)
            rounds.append(RoundSummary.model_validate(_read_json(folder / "round.json")))
            continue
        with log.stage(f"round{number}.capture"):
            activations.capture(current, splits.train, bld_rows, splits.scoring, folder / "activations",
                                max(1, plan.activation_chunk_tokens // plan.data.seq_len), log.in_round(number))
        with log.stage(f"round{number}.bld"):
            nmse = run_bld(current, variants, folder / "activations", plan.bld, folder / "bld", plan.seed,
                           log.in_round(number))
        scores = step.scores(current, variants, splits, rank_budget(plan, device))
        summary: dict[str, Any] = {}
        if parallel.is_main():
            summary, candidates = step.settle(current, parent, variants, scores, pricer, timer, parent_dir)
        parallel.barrier()
        budget = plan.gkd.model_copy(update={"tokens": max(1, plan.gkd.tokens // plan.rounds)})
        with log.stage(f"round{number}.gkd"):
            losses = gkd.distill(folder / "assembled", finished, parent, parent_dir, splits.train, budget,
                                 plan.seed + number, log.in_round(number), rank_budget(plan, device),
                                 60 * plan.checkpoint_minutes)
        if parallel.is_main():
            summary_model = RoundSummary(
                round=number, target=target.model_dump(include={"throughput", "latency", "memory_gib", "params",
                                                                 "active_params"}),
                achieved=summary["achieved"], score=summary["score"], alternatives=summary["alternatives"],
                predicted_speedup=summary["predicted_speedup"], measured_speedup=summary["measured_speedup"],
                measured_speedup_range=summary["measured_speedup_range"],
                searches=summary["searches"], gkd_loss_first=losses[0], gkd_loss_last=losses[-1],
                bld_nmse_median=statistics.median(nmse.values()) if nmse else 0.0)
            write_json(folder / "round.json", summary_model.model_dump())
            shutil.rmtree(folder / "activations")
            Checkpoints.clear(folder / gkd.CHECKPOINT_FOLDER)
        parallel.barrier()
        current = LazyDecoder(finished, frozen, device)
        rounds.append(RoundSummary.model_validate(_read_json(folder / "round.json")))
    if not parallel.is_main():
        log.save_peaks(out)
        parallel.finish()
        return None
    report = _finish(plan, out, parent, current, parent_dir, splits, pricer, candidates, rounds, log, source.value,
                     compute)
    log.save_peaks(out)
    parallel.finish()
    return report


def _finish(plan: Plan, out: Path, parent: LazyDecoder, child: LazyDecoder, parent_dir: Path, splits: Splits,
            pricer: Pricer, candidates: list[list[Candidate]], rounds: list[RoundSummary], log: Log,
            cost_source: str, compute: Compute) -> Report:
    fixed, parent_price = pricer.fixed, _parent_price(pricer, parent)  # as the last search saw them
    with log.stage("evaluation"):
        found = qualities({"parent": parent, "child": child}, [("parent", "parent"), ("child", "parent")],
                          splits.evaluation)
        parent_figures = _figures(parent, found[("parent", "parent")], plan)
        child_figures = _figures(child, found[("child", "parent")], plan)
        child_price = _parent_price(pricer, child)
    if candidates:
        with log.stage("pareto"):
            front = pareto(candidates, fixed, plan.target, parent_price)
            write_json(out / "pareto.json", front)
            _plot_pareto(front, out / "pareto.png", rounds[-1] if rounds else None, parent_price, child_price)
    with staged_folder(out / "child") as staging:
        shutil.copytree(child.folder, staging, dirs_exist_ok=True)
    report = Report(
        plan=plan.model_dump(mode="json", by_alias=True), parent=parent_figures, child=child_figures,
        cost_source=cost_source, predicted_speedup=parent_price.decode_s / child_price.decode_s,
        measured_speedup=None if child_figures.decode_tokens_per_second is None or
        parent_figures.decode_tokens_per_second is None else
        child_figures.decode_tokens_per_second / parent_figures.decode_tokens_per_second,
        measured_on=f"this machine ({parent.device.type}, {compute.dtype.value}) at batch {plan.target.batch} with "
                    f"{min(plan.target.context, plan.measure_context)} cached tokens"
                    if fits(parent.arch, plan, parent.device) else
                    "not measured: the parent does not fit budgetGiB whole",
        compute=compute, kl_to_parent=child_figures.quality.kl,
        perplexity_ratio=child_figures.quality.perplexity / parent_figures.quality.perplexity,
        blocks=[{kind: part_label(part) if part is not None else "" for kind, part in (("mixer", b.mixer),
                                                                                        ("ffn", b.ffn))}
                for b in child.arch.blocks],
        rounds=rounds, stage_seconds=log.seconds, wall_seconds=time.monotonic() - log.started)
    write_text(out / "report.md", report.markdown())
    write_json(out / "report.json", report.model_dump(mode="json"))
    log(f"report: {out / 'report.md'}")
    return report


def _plot_pareto(front: list[dict[str, float]], path: Path, last: RoundSummary | None, parent: Price,
                 child: Price) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot([p["throughput"] for p in front], [p["kl"] for p in front], "o-", label="MIP optimum per target")
    if last is not None:
        axes.plot([parent.decode_s / child.decode_s], [last.score], "r*", markersize=14, label="chosen child")
    axes.set_xlabel("predicted decode speed-up vs parent")
    axes.set_ylabel("sum of replace-1-block KL (nats/token)")
    axes.set_title("Quality vs throughput (last round's library)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    partial = path.with_name(f".{path.name}.partial.png")
    figure.savefig(partial, dpi=120)
    plt.close(figure)
    partial.replace(path)
