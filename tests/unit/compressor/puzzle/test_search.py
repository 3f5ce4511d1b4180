"""The MIP: exact against brute force, constraints and diversity honoured, infeasibility explained."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from tailor.compressor.puzzle.plan import Target
from tailor.compressor.puzzle.pricing import Price
from tailor.compressor.puzzle.search import Candidate, InfeasibleTarget, limits_for, pareto, solve


def price(**fields: Any) -> Price:
    """A price whose parameters are all active (no MoE in these instances)."""
    return Price(active_params=fields["params"], **fields)


FIXED = price(decode_s=1.0, prefill_s=1.0, weight_bytes=100.0, kv_bytes_per_token=0.0, params=100)


def instance(seed: int, slots: int = 5, options: int = 4) -> tuple[list[list[Candidate]], Price]:
    rng = random.Random(seed)
    out = []
    for i in range(slots):
        parent = price(decode_s=1.0, prefill_s=2.0, weight_bytes=50.0, kv_bytes_per_token=1.0, params=50)
        row = [Candidate(slot=i, label="parent", score=0.0, price=parent)]
        for j in range(1, options):
            share = rng.uniform(0.0, 0.95)
            row.append(Candidate(slot=i, label=f"v{j}", score=rng.uniform(0.0, 1.0) * (1 - share) + 0.01,
                                 price=price(decode_s=share, prefill_s=2 * share, weight_bytes=50.0 * share,
                                             kv_bytes_per_token=share, params=int(50 * share))))
        out.append(row)
    parent = price(decode_s=FIXED.decode_s + slots, prefill_s=FIXED.prefill_s + 2 * slots,
                   weight_bytes=FIXED.weight_bytes + 50 * slots, kv_bytes_per_token=slots, params=100 + 50 * slots)
    return out, parent


def brute_force(slots: list[list[Candidate]], limit_decode: float) -> float:
    best = float("inf")
    for combo in itertools.product(*slots):
        if FIXED.decode_s + sum(c.price.decode_s for c in combo) <= limit_decode + 1e-9:
            best = min(best, sum(c.score for c in combo))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_optimum_equals_brute_force(seed: int) -> None:
    slots, parent = instance(seed)
    target = Target(gpu="cpu", throughput=1.4)
    best = solve(slots, FIXED, target, limits_for(target, parent))[0]
    assert best.score == pytest.approx(brute_force(slots, parent.decode_s / 1.4), abs=1e-6)
    assert best.totals["decode_s"] <= parent.decode_s / 1.4 + 1e-9


def test_every_limit_holds_together() -> None:
    slots, parent = instance(7)
    target = Target(gpu="cpu", throughput=1.2, latency=1.2, params=0.8, memory_gib=500 / 2**30, context=10)
    best = solve(slots, FIXED, target, limits_for(target, parent))[0]
    assert best.totals["decode_s"] <= parent.decode_s / 1.2 + 1e-9
    assert best.totals["prefill_s"] <= parent.prefill_s / 1.2 + 1e-9
    assert best.totals["params"] <= 0.8 * parent.params + 1e-9
    assert best.totals["memory"] <= 500 + 1e-6
    assert set(best.achieved) == {"target.throughput", "target.latency", "target.params", "target.memoryGiB"}


def test_further_solutions_are_distinct_and_no_better() -> None:
    slots, parent = instance(3, slots=10)
    target = Target(gpu="cpu", throughput=1.3)
    found = solve(slots, FIXED, target, limits_for(target, parent), solutions=3, diversity=0.8)
    assert len(found) == 3
    assert [s.score for s in found] == sorted(s.score for s in found)
    for a, b in itertools.combinations(found, 2):
        assert sum(x == y for x, y in zip(a.labels, b.labels, strict=True)) <= 8


def test_an_unreachable_target_names_the_limit_and_the_best_value() -> None:
    slots, parent = instance(1)
    fastest = FIXED.decode_s + sum(min(c.price.decode_s for c in row) for row in slots)
    target = Target(gpu="cpu", throughput=50.0)
    with pytest.raises(InfeasibleTarget, match=rf"target.throughput cannot be met: the best child in the library "
                                               rf"reaches {parent.decode_s / fastest:.3f}x \(asked for 50.000x\)"):
        solve(slots, FIXED, target, limits_for(target, parent))


def test_limits_that_conflict_only_together_say_so() -> None:
    slots = [[Candidate(slot=0, label="fast-big", score=0.0, price=price(decode_s=0.1, prefill_s=1, weight_bytes=1,
                                                                          kv_bytes_per_token=0, params=100)),
              Candidate(slot=0, label="slow-small", score=0.0, price=price(decode_s=1.0, prefill_s=1, weight_bytes=1,
                                                                            kv_bytes_per_token=0, params=10))]]
    parent = price(decode_s=2.0, prefill_s=2, weight_bytes=101, kv_bytes_per_token=0, params=200)
    target = Target(gpu="cpu", throughput=1.5, params=0.6)
    with pytest.raises(InfeasibleTarget, match=r"target.throughput cannot be met together with target.params: "
                                               r"under those the best child reaches 1.000x"):
        solve(slots, FIXED, target, limits_for(target, parent))


def test_the_pareto_front_is_monotone() -> None:
    slots, parent = instance(5, slots=8)
    front = pareto(slots, FIXED, Target(gpu="cpu", throughput=1.1), parent, points=6)
    assert front[0]["kl"] == pytest.approx(0.0)
    assert all(b["kl"] >= a["kl"] - 1e-9 for a, b in itertools.pairwise(front))
    assert all(b["throughput"] >= a["throughput"] - 1e-9 for a, b in itertools.pairwise(front))


def with_states(slots: list[list[Candidate]], seed: int) -> list[list[Candidate]]:
    """Slots 0, 2 and 4 become Mamba blocks: their variants carry an SSM state size (None for a removal)."""
    rng = random.Random(seed)
    return [[c.model_copy(update={"state": rng.choice([16, 12, 8, None]) if j else 16}) if i % 2 == 0 else c
             for j, c in enumerate(row)] for i, row in enumerate(slots)]


@pytest.mark.parametrize("seed", range(6))
def test_one_ssm_state_size_for_every_mamba_block_and_still_optimal(seed: int) -> None:
    slots, parent = instance(seed, options=5)
    slots = with_states(slots, seed)
    target = Target(gpu="cpu", throughput=1.4)
    best = solve(slots, FIXED, target, limits_for(target, parent))[0]
    chosen = [next(c for c in row if c.label == label) for row, label in zip(slots, best.labels, strict=True)]
    assert len({c.state for c in chosen if c.state is not None}) <= 1
    uniform = [combo for combo in itertools.product(*slots)
               if len({c.state for c in combo if c.state is not None}) <= 1]
    limit = parent.decode_s / 1.4
    expected = min(sum(c.score for c in combo) for combo in uniform
                   if FIXED.decode_s + sum(c.price.decode_s for c in combo) <= limit + 1e-9)
    assert best.score == pytest.approx(expected, abs=1e-6)


def test_an_active_parameter_cap_prefers_fewer_active_parameters_at_equal_size() -> None:
    # two MoE variants of one block, equal in size: routing to fewer experts scores worse but meets the cap
    wide = Price(decode_s=1.0, prefill_s=1, weight_bytes=1, kv_bytes_per_token=0, params=100, active_params=80)
    narrow = wide.model_copy(update={"active_params": 20})
    slots = [[Candidate(slot=0, label="top-8", score=0.0, price=wide),
              Candidate(slot=0, label="top-2", score=0.5, price=narrow)]]
    parent = Price.total([FIXED, wide])  # 180 active
    assert solve(slots, FIXED, Target(gpu="cpu", params=1.0), limits_for(Target(gpu="cpu", params=1.0),
                                                                          parent))[0].labels == ["top-8"]
    capped = Target(gpu="cpu", active_params=0.75)  # 135 active: the fixed 100 plus at most 35
    best = solve(slots, FIXED, capped, limits_for(capped, parent))[0]
    assert best.labels == ["top-2"] and best.totals["active_params"] == 120
    assert best.achieved["target.activeParams"].startswith("0.667 of the parent's active parameters")


@pytest.mark.parametrize("seed", range(3))
def test_a_per_request_speed_floor_is_a_step_time_limit(seed: int) -> None:
    """Puzzle's per-user floor: every request decodes at `requestTokensPerSecond` at the target batch, so a whole
    step takes at most 1/floor seconds (here the parent's step is 6 s: a floor of 1/4.5 tokens/s per request)."""
    slots, parent = instance(seed)
    target = Target(gpu="cpu", request_tokens_per_second=1 / 4.5)
    best = solve(slots, FIXED, target, limits_for(target, parent))[0]
    assert best.totals["decode_s"] <= 4.5 + 1e-9
    assert best.score == pytest.approx(brute_force(slots, 4.5), abs=1e-6)
    assert best.achieved["target.requestTokensPerSecond"] == f"{1 / best.totals['decode_s']:.1f} tokens/s per request"
    with pytest.raises(InfeasibleTarget, match=r"target\.requestTokensPerSecond cannot be met: .* tokens/s per "
                                               r"request"):
        impossible = Target(gpu="cpu", request_tokens_per_second=10.0)
        solve(slots, FIXED, impossible, limits_for(impossible, parent))
