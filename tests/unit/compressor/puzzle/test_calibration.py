"""Measured costs that check themselves. Timings are injected (a fake clock: each block costs in proportion to
its parameters, a whole step costs its blocks plus a fixed rest, and whatever each kept block adds in a whole
step), so each test decides what the machine "measured" and checks what the pipeline makes of it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tailor.compressor.model.architecture import Architecture, Attention, Block, Mlp, NoOp, Part
from tailor.compressor.model.modeling import Decoder, ModelSettings
from tailor.compressor.puzzle import calibration, measure, pipeline
from tailor.compressor.puzzle.calibration import (
    CalibrationError,
    PairedSpeedup,
    SpeedCheckError,
    calibrate,
    without_blocks,
)
from tailor.compressor.puzzle.plan import Plan, Target
from tailor.compressor.puzzle.pricing import Pricer
from tailor.compressor.sizing.costs import Phase, Workload

from plans import tiny_plan

HIDDEN = 64
WORK = Workload(phase=Phase.DECODE, batch=1, context=32)
HEAD_S = 0.002


def cost(part: Part) -> float:
    """The fake clock's seconds for one block: 1 ms per 10k parameters, and a little for a removed one."""
    return 1e-3 * sum(part.params(HIDDEN).values()) / 1e4 + 1e-5


def decoder() -> Decoder:
    block = Block(mixer=Attention(num_heads=4, num_kv_heads=2, head_dim=16), ffn=Mlp(intermediate_size=256, gated=True))
    arch = Architecture(name="tiny", hidden_size=HIDDEN, vocab_size=500, tie_word_embeddings=True, blocks=[block] * 3)
    return Decoder(arch, ModelSettings()).eval()


def kept(model: Decoder) -> int:
    return sum(not isinstance(slot.part, NoOp) for slot in model.slots())


class Clock:
    """Fake timings: a block runner costs `cost(part)`; a whole step of a model with blocks costs the next of
    `steps`, or its blocks plus `rest` plus `per_block` for each block it keeps."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, steps: Iterator[float] | None = None,
                 rest: float = 0.004, per_block: float = 0.0) -> None:
        self.steps, self.rest, self.per_block = steps, rest, per_block
        monkeypatch.setattr(measure.MeasuredCosts, "fresh", lambda _, part, *__: self.tagged(part=part))
        monkeypatch.setattr(measure.MeasuredCosts, "seconds", lambda _, part, *__: cost(part))
        monkeypatch.setattr(measure.MeasuredCosts, "head_seconds", lambda *_: HEAD_S)
        monkeypatch.setattr(calibration, "decode_step_runner", lambda model, *_: self.tagged(model=model))
        monkeypatch.setattr(calibration, "time_call", self.time_call)

    @staticmethod
    def tagged(**what: object) -> Callable[[], object]:
        def run() -> object:
            return what
        run.what = what  # type: ignore[attr-defined]
        return run

    def time_call(self, run: Callable[[], object], _device: torch.device, **_: object) -> float:
        what = run.what  # type: ignore[attr-defined]
        if "part" in what:
            return cost(what["part"])
        model = what["model"]
        if self.steps is not None and kept(model):
            return next(self.steps)
        return sum(cost(slot.part) for slot in model.slots()) + self.rest + self.per_block * kept(model)


@pytest.fixture
def timer(tmp_path: Path) -> measure.MeasuredCosts:
    return measure.MeasuredCosts(cache_file=tmp_path / "costs.json", dev=torch.device("cpu"))


def test_one_slow_parent_step_does_not_decide_the_fixed_cost(monkeypatch: pytest.MonkeyPatch,
                                                             timer: measure.MeasuredCosts) -> None:
    model = decoder()
    blocks = sum(cost(slot.part) for slot in model.slots())
    Clock(monkeypatch, iter([blocks + 0.004, blocks + 0.040, blocks + 0.004, blocks + 0.004, blocks + 0.004]))
    found = calibrate(model, timer, WORK, print)
    assert found.rest_s == pytest.approx(0.004) and found.blocks_s == pytest.approx(blocks)
    assert found.rounds == 5 and found.spread == pytest.approx(0.0)


def test_what_each_block_adds_to_a_whole_step_is_priced_so_removing_blocks_saves_it(
        monkeypatch: pytest.MonkeyPatch, timer: measure.MeasuredCosts) -> None:
    """A whole step costs 0.5 ms per kept block beyond the blocks timed alone. The calibration tells that apart
    from the fixed cost (the parent timed with every block removed), and the pricer's prediction for a child
    without its last layer is that child's step on the same clock; booking it all as fixed cost is not."""
    model = decoder()
    clock = Clock(monkeypatch, per_block=0.0005)
    found = calibrate(model, timer, WORK, print)
    empty = without_blocks(model)
    assert found.fixed_s == pytest.approx(clock.time_call(clock.tagged(model=empty), torch.device("cpu")))
    assert found.per_block_s == pytest.approx(0.0005, rel=0.05)
    assert found.rest_s == pytest.approx(found.fixed_s + 6 * found.per_block_s)

    pricer = Pricer(model.arch, Target(gpu="cpu", batch=1, context=32, throughput=1.1), timer)
    pricer.calibrate_decode(found.fixed_s, found.per_block_s)
    child = [NoOp() if slot.layer == 2 else slot.part for slot in model.slots()]
    predicted = pricer.fixed.decode_s + sum(pricer.price(part, slot.kind).decode_s
                                            for part, slot in zip(child, model.slots(), strict=True))
    on_the_clock = sum(cost(part) for part in child) + clock.rest + clock.per_block * 4
    assert predicted == pytest.approx(on_the_clock, rel=1e-2)
    assert found.rest_s + sum(cost(part) for part in child) != pytest.approx(on_the_clock, rel=1e-2)


def test_the_emptied_parent_shares_its_ends_and_keeps_no_block() -> None:
    model = decoder()
    empty = without_blocks(model)
    assert kept(empty) == 0 and len(empty.slots()) == len(model.slots())
    shared = model.embedding.weight.data_ptr()  # the same storage: nothing is copied
    assert empty.embedding.weight.data_ptr() == shared and empty.lm_head.weight.data_ptr() == shared
    ids = torch.randint(0, 500, (1, 5))
    with torch.no_grad():
        expected = model.lm_head(model.final_norm(model.embedding(ids)))
        assert torch.equal(empty(ids), expected)


def test_a_parent_step_timed_under_other_conditions_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                               timer: measure.MeasuredCosts) -> None:
    """The issue's case: a step three times its blocks, every time; asked twice (5, then 10 pairs), then refused."""
    model = decoder()
    blocks = sum(cost(slot.part) for slot in model.slots())
    Clock(monkeypatch, iter([3 * blocks + 0.004] * 15))
    lines: list[str] = []
    with pytest.raises(CalibrationError, match=r"would be fixed cost; its LM head takes 2\.00 ms.*target\.costs: "
                                               r"roofline"):
        calibrate(model, timer, WORK, lines.append)
    assert any("timing 10 pairs instead" in line for line in lines)


def test_cached_timings_taken_under_other_conditions_are_dropped(monkeypatch: pytest.MonkeyPatch,
                                                                 timer: measure.MeasuredCosts) -> None:
    model = decoder()
    keys = {timer.key(slot.part, HIDDEN, WORK): slot.part for slot in model.slots()}
    timer.remember({**{key: 2 * cost(part) for key, part in keys.items()}, "a-variant": 1.0})
    Clock(monkeypatch)
    found = calibrate(model, timer, WORK, print)
    assert found.stale and found.cache_drift == pytest.approx(1.0)
    assert timer.cache == {key: pytest.approx(cost(part)) for key, part in keys.items()}  # the variant is gone


def _measured_run(monkeypatch: pytest.MonkeyPatch, parent: Path, tmp_path: Path, measured: float,
                  misses: Iterator[float] | None = None) -> Plan:
    """A tiny compression on measured costs (the fake clock, a cost cache of its own), its assembled child
    "measuring" `measured` x the parent's speed; `misses` replaces how far that is from each prediction."""
    Clock(monkeypatch)
    monkeypatch.setattr(pipeline, "MeasuredCosts",
                        lambda dev, dtype: measure.MeasuredCosts(cache_file=tmp_path / "costs.json", dev=dev,
                                                                 dtype=dtype))
    monkeypatch.setattr(pipeline, "measured_speedup",
                        lambda *_: PairedSpeedup(median=measured, low=0.9 * measured, high=1.1 * measured, pairs=5))
    if misses is not None:
        monkeypatch.setattr(pipeline, "speed_miss", lambda *_: next(misses))
    return Plan.model_validate(tiny_plan(parent, target={"gpu": "cpu", "throughput": 1.2, "context": 32,
                                                         "costs": "measured"}))


def test_a_child_far_off_its_predicted_speed_is_searched_again_then_refused(
        monkeypatch: pytest.MonkeyPatch, tiny_parent: Path, tmp_path: Path) -> None:
    """Injected: the assembled child measures 50x the parent's decode speed, whatever the search predicted. The
    pipeline times every variant and the parent again and searches again, twice, then fails naming both."""
    plan = _measured_run(monkeypatch, tiny_parent, tmp_path, measured=50.0)
    with pytest.raises(SpeedCheckError, match=r"round 1: the child measured 50\.000x the parent's decode speed, the "
                                              r"search predicted \d\.\d+x \(more than 30% apart\) after 3 searches"):
        pipeline.compress(plan, tmp_path / "out")
    assert not (tmp_path / "out" / "report.json").exists()


def test_a_miss_that_goes_away_once_re_measured_is_reported(monkeypatch: pytest.MonkeyPatch, tiny_parent: Path,
                                                            tmp_path: Path) -> None:
    plan = _measured_run(monkeypatch, tiny_parent, tmp_path, measured=1.25, misses=iter([0.9, 0.01]))
    report = pipeline.compress(plan, tmp_path / "out")
    assert report is not None
    (summary,) = report.rounds
    assert summary.searches == 2 and summary.measured_speedup == 1.25 and summary.predicted_speedup >= 1.2 - 1e-9
    assert summary.measured_speedup_range == pytest.approx([1.125, 1.375])
    assert "| 1.2" in report.markdown() and "x / 1.250 (1.125-1.375) | 2 |" in report.markdown()
