"""Measured costs that check themselves: the fixed cost of a decode step from paired timings, and the child's
speed-up measured against the search's prediction.

Measured costs time each block variant alone. A whole decode step costs more than its blocks: the LM head and the
embedding, and the work a block causes in a whole model that timing it alone misses (its call and its share of the
step's cache traffic). That rest is calibrated on the parent: its whole step, the same model with every block
removed (embedding, final norm, LM head: the fixed cost) and its blocks are timed side by side, `ROUNDS` times
interleaved and fresh (never from the cache). The fixed cost is the median of the emptied model's timings; what
remains of the rest is spread over the parent's blocks as a cost each kept block adds (`per_block_s`), so a child
that removes blocks is predicted to save that too. Medians of the paired differences: one slow sample cannot decide
either.

The split is refused, with the figures, when it is implausible after a second try with twice the pairs: the
rest, or the emptied model's step, is more than `HEAD_MULTIPLE` LM heads (timed alone) plus `OVERHEAD_SHARE` of a
step, or the rest is below -`OVERHEAD_SHARE` of a step (blocks alone slower than the whole). Differences that
scatter by more than `MAX_SPREAD` of a step (a busy machine) also earn the second try; their median is then used,
and the log says how much they scattered.
Block timings cached by earlier runs are kept only if the parent's blocks, timed fresh now, agree with them
within `CACHE_DRIFT`. Otherwise they are dropped, and every variant is timed again in this run.

After assembly, the child's whole step is timed beside the parent's, and the measured speed-up is compared
with the prediction (`speedup_check`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable

import torch
from pydantic import BaseModel

from tailor.compressor.model.architecture import Block, NoOp
from tailor.compressor.model.modeling import Decoder
from tailor.compressor.puzzle.measure import MeasuredCosts, decode_step_runner, time_call
from tailor.compressor.sizing.costs import Workload

ROUNDS = 5
HEAD_MULTIPLE = 3.0  # the fixed cost is the LM head and the work between blocks: a few heads' worth at most ...
OVERHEAD_SHARE = 0.25  # ... plus this share of a step; more means the step and the blocks were timed apart
MAX_SPREAD = 0.25  # median absolute deviation of the paired differences, as a share of a parent step
CACHE_DRIFT = 0.2  # cached block timings more than this far from fresh ones were taken under other conditions
SPEED_TOLERANCE = 0.3  # measured speed-up / predicted, either way, before the search is re-measured and re-run
RESOLVES = 2  # re-measured searches before a miss fails the run
Progress = Callable[[str], None]


class CalibrationError(ValueError):
    """Timings that cannot be trusted: the message gives them and what to do."""


class SpeedCheckError(ValueError):
    """A child whose measured speed-up stayed off the prediction after re-measured searches."""


class Calibration(BaseModel):
    """The parent's decode step against its blocks, timed in pairs (seconds, medians)."""

    step_s: float
    blocks_s: float
    head_s: float  # the LM head timed alone
    rest_s: float  # median of the paired differences: step - blocks
    fixed_s: float  # the step of the parent with every block removed
    per_block_s: float  # what each kept block adds beyond its own timing: (rest - fixed) / blocks, median
    spread: float  # their median absolute deviation, as a share of the step
    rounds: int
    cache_drift: float | None  # cached / fresh block timings - 1, where the cache held them
    stale: bool  # the cache was dropped


def _median_pairs(pairs: list[tuple[float, float]]) -> tuple[float, float, float, float]:
    steps, blocks = zip(*pairs, strict=True)
    differences = [s - b for s, b in pairs]
    rest = statistics.median(differences)
    step = statistics.median(steps)
    spread = statistics.median(abs(d - rest) for d in differences) / step
    return step, statistics.median(blocks), rest, spread


def without_blocks(model: Decoder) -> Decoder:
    """`model` with every block removed: its embedding, final norm and LM head (shared, not copied), and the loop
    over its layers."""
    blocks = [Block(**{kind: NoOp() for kind in ("mixer", "ffn") if getattr(block, kind) is not None})
              for block in model.arch.blocks]
    with torch.device("meta"):
        empty = Decoder(model.arch.model_copy(update={"blocks": blocks}), model.settings)
    weights = model.state_dict()
    empty.load_state_dict({name: weights[name] for name in empty.state_dict()}, assign=True)
    return empty.eval()


def calibrate(model: Decoder, timer: MeasuredCosts, work: Workload, progress: Progress,
              rounds: int = ROUNDS) -> Calibration:
    """Time the parent's whole step and its blocks in `rounds` interleaved pairs; refuse an implausible split."""
    hidden = model.arch.hidden_size
    keys = [timer.key(slot.part, hidden, work) for slot in model.slots()]
    counts = Counter(keys)
    parts = {key: slot.part for key, slot in zip(keys, model.slots(), strict=True)}
    runners = {key: timer.fresh(part, hidden, work) for key, part in parts.items()}
    step = decode_step_runner(model, work.batch, work.context, timer.dtype)
    empty = decode_step_runner(without_blocks(model), work.batch, work.context, timer.dtype)
    kept = sum(not isinstance(slot.part, NoOp) for slot in model.slots())
    device = model.embedding.weight.device
    pairs: list[tuple[float, float]] = []
    fresh: dict[str, list[float]] = {key: [] for key in runners}
    fixed: list[float] = []
    for _ in range(rounds):
        whole = time_call(step, device, min_seconds=0.1)
        fixed.append(time_call(empty, device, min_seconds=0.05))
        for key, run in runners.items():
            fresh[key].append(time_call(run, device, min_seconds=0.05))
        pairs.append((whole, sum(counts[key] * fresh[key][-1] for key in runners)))
    del step, empty
    step_s, blocks_s, rest_s, spread = _median_pairs(pairs)
    fixed_s = statistics.median(fixed)
    per_block_s = statistics.median((s - b - f) / max(1, kept) for (s, b), f in zip(pairs, fixed, strict=True))
    medians = {key: statistics.median(values) for key, values in fresh.items()}
    cached = [key for key in keys if key in timer.cache]
    drift = None
    if cached:  # the parent's blocks the cache holds, against the same blocks timed now
        drift = sum(timer.cache[key] for key in cached) / sum(medians[key] for key in cached) - 1
    stale = drift is not None and abs(drift) > CACHE_DRIFT
    if stale:
        progress(f"costs: cached block timings are {drift:+.0%} off the parent's blocks timed now; dropping them, "
                 "every variant is timed again")
    timer.remember(medians, forget_the_rest=stale)
    head_s = timer.head_seconds(hidden, model.arch.vocab_size, work)
    found = Calibration(step_s=step_s, blocks_s=blocks_s, head_s=head_s, rest_s=rest_s, fixed_s=fixed_s,
                        per_block_s=per_block_s, spread=spread, rounds=rounds, cache_drift=drift, stale=stale)
    problem = implausible(found)
    scattered = (f"the parent's step minus its blocks varied by {spread:.0%} of a step between {rounds} paired "
                 f"timings (more than {MAX_SPREAD:.0%})") if spread > MAX_SPREAD else None
    if (problem or scattered) and rounds == ROUNDS:
        progress(f"costs: {problem or scattered}; timing {2 * rounds} pairs instead")
        again = calibrate(model, timer, work, progress, 2 * rounds)
        return again.model_copy(update={"stale": stale or again.stale})
    if problem:
        raise CalibrationError(f"costs: {problem}; the timings on this machine are too noisy to price the search "
                               "(run on a quiet machine, or set target.costs: roofline)")
    if scattered:
        progress(f"costs: warning: {scattered}; a busy machine: the median is used")
    progress(f"costs: a parent decode step takes {step_s * 1e3:.2f} ms, its blocks {blocks_s * 1e3:.2f} ms when timed "
             f"alone; of the rest ({rest_s * 1e3:.2f} ms), {fixed_s * 1e3:.2f} ms is the fixed cost (the step with "
             f"every block removed) and {per_block_s * 1e3:.3f} ms what each of its {kept} blocks adds beyond its own "
             f"timing (medians of {rounds} interleaved pairs, spread {spread:.1%} of a step)")
    return found


def implausible(found: Calibration) -> str | None:
    """Why a calibration cannot be trusted, or None."""
    ceiling = HEAD_MULTIPLE * found.head_s + OVERHEAD_SHARE * found.step_s
    if not -OVERHEAD_SHARE * found.step_s <= found.rest_s <= ceiling:
        return (f"a parent decode step took {found.step_s * 1e3:.2f} ms and its blocks {found.blocks_s * 1e3:.2f} "
                f"ms when timed alone, so {found.rest_s * 1e3:.2f} ms would be fixed cost; its LM head takes "
                f"{found.head_s * 1e3:.2f} ms, so at most {ceiling * 1e3:.2f} ms is plausible")
    if found.fixed_s > ceiling:
        return (f"the parent with every block removed took {found.fixed_s * 1e3:.2f} ms a step; its LM head takes "
                f"{found.head_s * 1e3:.2f} ms, so at most {ceiling * 1e3:.2f} ms is plausible")
    return None


class PairedSpeedup(BaseModel):
    """A speed-up from interleaved pairs of step timings: their median, the range they span, and how many."""

    median: float
    low: float
    high: float
    pairs: int

    def describe(self) -> str:
        return f"{self.median:.3f}x ({self.low:.3f}-{self.high:.3f} over {self.pairs} interleaved pairs)"


def measured_speedup(parent: Decoder, child: Decoder, work: Workload, dtype: torch.dtype,
                     rounds: int = ROUNDS) -> PairedSpeedup:
    """The child's decode speed-up over the parent in `rounds` paired step timings, both in `dtype`."""
    pairs = speedup_pairs(parent, child, work, dtype, rounds)
    return PairedSpeedup(median=statistics.median(pairs), low=min(pairs), high=max(pairs), pairs=len(pairs))


def speedup_pairs(parent: Decoder, child: Decoder, work: Workload, dtype: torch.dtype,
                  rounds: int = ROUNDS) -> list[float]:
    """The child's decode speed-up over the parent in each of `rounds` interleaved pairs of step timings."""
    device = parent.embedding.weight.device
    runners = [decode_step_runner(model, work.batch, work.context, dtype) for model in (parent, child)]
    ratios = []
    for _ in range(rounds):
        parent_s, child_s = (time_call(run, device, min_seconds=0.1) for run in runners)
        ratios.append(parent_s / child_s)
    del runners
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ratios


def speed_miss(predicted: float, measured: float) -> float:
    """How far the measured speed-up is from the prediction, as a share of it (either way)."""
    return abs(measured / predicted - 1)
