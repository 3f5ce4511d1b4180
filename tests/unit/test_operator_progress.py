"""How far a running stage is, from the lines the stages log."""

from __future__ import annotations

from tailor.operator.progress import LOG_TAIL_LINES, StepProgress, duration, parse

COMPRESS_LOG = """\
[   3.1s] data: 9000/512/512 tokens (train, scoring, evaluation)
[   4.0s] round2.library: start (1.2 GiB held)
[   4.2s] round2.library: done in 0.2s, peak 1.3 GiB
[   4.3s] round2.bld: start (1.3 GiB held)
[ 120.5s] rank 0 bld: 411/1536 slot 40 (attention, layer 40) gqa-2: nmse 0.0312, eta 11460s
[ 121.0s] rank 0 bld: 412/1536 slot 40 (attention, layer 40) gqa-4: nmse 0.0201, eta 11400s
[ 121.1s] rank 1 peak memory 40.2 GiB
"""


def test_the_last_step_line_and_its_round_give_the_stage_progress() -> None:
    step = parse(COMPRESS_LOG)
    assert step == StepProgress(step="bld", done=412, total=1536, eta_s=11400, round=2)
    assert step.describe(rounds=3) == "round 2/3: bld 412/1,536, eta 3h10m"
    assert round(step.share, 3) == 0.268


def test_every_stage_line_the_compressor_writes_is_read() -> None:
    scoring = parse("[  50.0s] round1.scoring: start\n[  61.2s] round1.scoring: 40/96 variants, eta 300s\n")
    assert scoring is not None and scoring.describe(rounds=1) == "round 1/1: scoring 40/96 variants, eta 5m"
    gkd = parse("[ 900.0s] rank 0 round3.gkd: step 120/400, 3932160 tokens, loss 1.2345, eta 3000s\n")
    assert gkd is not None and (gkd.step, gkd.done, gkd.total, gkd.round) == ("gkd", 120, 400, 3)
    capture = parse("[  10.0s] round1.capture: slot 7/88\n")
    assert capture is not None and capture.describe(rounds=1) == "round 1/1: capture 7/88" and capture.eta_s is None
    alone = parse("[ 900.0s] gkd: step 120/400, 3932160 tokens, loss 1.2345, eta 3000s\n")  # outside any round
    assert alone is not None and alone.round is None


def test_a_round_with_more_step_lines_than_the_tail_still_names_its_round() -> None:
    """The operator reads the last LOG_TAIL_LINES lines: a round's start is long gone from them after a few
    dozen BLD variants (a real library has thousands), and its step lines name the round themselves."""
    lines = [f"[{i:6.1f}s] round2.bld: {i}/1536 slot 3 (ffn, layer 3) ffn-512: nmse 0.0201, eta 900s"
             for i in range(1, LOG_TAIL_LINES + 10)]
    step = parse("\n".join(lines[-LOG_TAIL_LINES:]))
    assert step is not None and step.round == 2 and step.done == LOG_TAIL_LINES + 9


def test_a_log_without_step_lines_says_nothing() -> None:
    assert parse("") is None
    assert parse("Loading checkpoint shards\nround 1: resuming from /artifacts/round1\n") is None
    assert parse("[   3.1s] data: 9000/512/512 tokens (train, scoring, evaluation)\n") is None


def test_durations_read_as_people_write_them() -> None:
    assert [duration(s) for s in (45, 720, 11400, 90000)] == ["45s", "12m", "3h10m", "25h00m"]
