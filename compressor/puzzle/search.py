"""Stage 5, search: the mixed-integer program that picks one variant per slot, solved exactly by HiGHS.

    minimise   sum_ij score_ij x_ij                       (replace-1-block KL: lower is better)
    subject to sum_j x_ij = 1                             for every slot i
               fixed_r + sum_ij cost_r(ij) x_ij <= limit_r for every limit r (decode and prefill time,
                                                          memory, parameters)
               sum_{ij in y} x_ij <= floor(diversity * slots) for every earlier solution y
               sum_{j: state_ij = s} x_ij <= z_s, sum_s z_s = 1  (one SSM state size for every Mamba block,
                                                          as serving engines require; z_s binary)

An infeasible target names the limit that cannot be met and the best value the library reaches.
`pareto` sweeps the throughput target to draw quality against predicted speed. No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import BaseModel
from scipy.optimize import Bounds, LinearConstraint, milp

from tailor.compressor.puzzle.plan import Target
from tailor.compressor.puzzle.pricing import Price

REQUEST_SPEED = "target.requestTokensPerSecond"


class InfeasibleTarget(ValueError):
    """No child in the library meets the target; the message says which limit and what is reachable."""


class Candidate(BaseModel):
    slot: int
    label: str
    score: float
    price: Price
    state: int | None = None  # SSM state size of a Mamba variant: the same for every Mamba block


class Limit(BaseModel):
    """One linear constraint in the user's terms: `field` of the plan, the parent's total, the limit."""

    field: str
    resource: str  # decode_s | prefill_s | memory | params | active_params
    limit: float
    parent_total: float
    higher_is_better: bool  # throughput and latency are ratios where more is better

    def amount(self, price: Price, target: Target) -> float:
        if self.resource == "memory":
            return price.memory_bytes(target)
        return float(getattr(price, self.resource))

    def describe(self, total: float) -> str:
        """A total in the plan's units: a speed-up ratio, tokens/s per request, GiB, or a share of the parent's
        parameters."""
        if self.field == REQUEST_SPEED:
            return f"{1 / total:.1f} tokens/s per request"
        if self.resource in ("decode_s", "prefill_s"):
            return f"{self.parent_total / total:.3f}x"
        if self.resource == "memory":
            return f"{total / 2**30:.3f} GiB"
        kind = "active parameters" if self.resource == "active_params" else "parameters"
        return f"{total / self.parent_total:.3f} of the parent's {kind} ({total / 1e9:.3g}B)"


def limits_for(target: Target, parent: Price) -> list[Limit]:
    """The plan's targets as limits on totals, given the parent's totals (fixed part included)."""
    out = []
    if target.throughput is not None:
        out.append(Limit(field="target.throughput", resource="decode_s", limit=parent.decode_s / target.throughput,
                         parent_total=parent.decode_s, higher_is_better=True))
    if target.request_tokens_per_second is not None:
        out.append(Limit(field=REQUEST_SPEED, resource="decode_s", limit=1 / target.request_tokens_per_second,
                         parent_total=parent.decode_s, higher_is_better=True))
    if target.latency is not None:
        out.append(Limit(field="target.latency", resource="prefill_s", limit=parent.prefill_s / target.latency,
                         parent_total=parent.prefill_s, higher_is_better=True))
    if target.memory_gib is not None:
        out.append(Limit(field="target.memoryGiB", resource="memory", limit=target.memory_gib * 2**30,
                         parent_total=parent.memory_bytes(target), higher_is_better=False))
    if target.params is not None:
        out.append(Limit(field="target.params", resource="params", limit=target.params * parent.params,
                         parent_total=parent.params, higher_is_better=False))
    if target.active_params is not None:
        out.append(Limit(field="target.activeParams", resource="active_params",
                         limit=target.active_params * parent.active_params, parent_total=parent.active_params,
                         higher_is_better=False))
    return out


class Solution(BaseModel):
    labels: list[str]  # the chosen variant of every slot
    score: float  # sum of replace-1-block KLs
    totals: dict[str, float]  # resource -> total, fixed part included
    achieved: dict[str, str]  # plan field -> value in the plan's units


def _totals(chosen: list[Candidate], fixed: Price, target: Target) -> dict[str, float]:
    total = {"decode_s": fixed.decode_s, "prefill_s": fixed.prefill_s, "memory": fixed.memory_bytes(target),
             "params": float(fixed.params), "active_params": float(fixed.active_params)}
    for c in chosen:
        total["decode_s"] += c.price.decode_s
        total["prefill_s"] += c.price.prefill_s
        total["memory"] += c.price.memory_bytes(target)
        total["params"] += c.price.params
        total["active_params"] += c.price.active_params
    return total


def _milp(slots: list[list[Candidate]], fixed: Price, target: Target, limits: list[Limit],
          objective: Callable[[Candidate], float], exclude: list[list[str]],
          diversity: float) -> list[Candidate] | None:
    positions = [i for i, options in enumerate(slots) for _ in options]
    flat = [c for options in slots for c in options]
    states = sorted({c.state for c in flat if c.state is not None})
    n, width = len(flat), len(flat) + len(states)  # one binary z_s per state size after the x_ij
    rows: list[np.ndarray[Any, Any]] = []
    lower: list[float] = []
    upper: list[float] = []

    def add(values: list[float] | np.ndarray[Any, Any], low: float, high: float) -> None:
        row = np.zeros(width)
        row[:len(values)] = values
        rows.append(row)
        lower.append(low)
        upper.append(high)

    for slot in range(len(slots)):
        add([1.0 if i == slot else 0.0 for i in positions], 1, 1)
    fixed_totals = _totals([], fixed, target)
    for limit in limits:  # scaled by the limit: HiGHS's feasibility tolerance is absolute (about 1e-7)
        scale = abs(limit.limit) or 1.0
        add(np.array([limit.amount(c.price, target) for c in flat]) / scale, -np.inf,
            (limit.limit - fixed_totals[limit.resource]) / scale)
    shared = math.floor(diversity * len(slots))
    for labels in exclude:
        add([1.0 if labels[i] == c.label else 0.0 for i, c in zip(positions, flat, strict=True)], -np.inf, shared)
    if states:
        add([0.0] * n + [1.0] * len(states), 1, 1)
        for slot in sorted({i for i, c in zip(positions, flat, strict=True) if c.state is not None}):
            for k, state in enumerate(states):
                row = [1.0 if i == slot and c.state == state else 0.0 for i, c in zip(positions, flat, strict=True)]
                add(row + [-1.0 if j == k else 0.0 for j in range(len(states))], -np.inf, 0)
    costs = np.array([objective(c) for c in flat] + [0.0] * len(states))
    result = milp(c=costs, integrality=np.ones(width), bounds=Bounds(0, 1),
                  constraints=LinearConstraint(np.array(rows), lower, upper))
    if result.status != 0 or result.x is None:
        return None
    return [c for c, x in zip(flat, result.x[:n], strict=True) if x > 0.5]


def _diagnose(slots: list[list[Candidate]], fixed: Price, target: Target, limits: list[Limit]) -> str:
    """Which limit fails: alone (the best the library reaches) or only together with the others."""
    problems = []
    for limit in limits:
        best = fixed.memory_bytes(target) if limit.resource == "memory" else float(getattr(
            fixed, limit.resource))
        best += sum(min(limit.amount(c.price, target) for c in options) for options in slots)
        if best > limit.limit:
            problems.append(f"{limit.field} cannot be met: the best child in the library reaches "
                            f"{limit.describe(best)} (asked for {limit.describe(limit.limit)})")
    if problems:
        return "; ".join(problems)
    first, others = limits[0], limits[1:]
    best_under_others = _milp(slots, fixed, target, others, lambda c: first.amount(c.price, target), [], 1.0)
    if best_under_others is None:
        return "the limits cannot be met together"
    reached = _totals(best_under_others, fixed, target)[first.resource]
    return (f"{first.field} cannot be met together with {', '.join(x.field for x in others)}: under those the "
            f"best child reaches {first.describe(reached)} (asked for {first.describe(first.limit)})")


def solve(slots: list[list[Candidate]], fixed: Price, target: Target, limits: list[Limit], solutions: int = 1,
          diversity: float = 0.8) -> list[Solution]:
    """Up to `solutions` distinct optimal children, best first; InfeasibleTarget when there is none."""
    found: list[Solution] = []
    while len(found) < solutions:
        chosen = _milp(slots, fixed, target, limits, lambda c: c.score, [s.labels for s in found], diversity)
        if chosen is None:
            if not found:
                raise InfeasibleTarget(_diagnose(slots, fixed, target, limits))
            break
        totals = _totals(chosen, fixed, target)
        found.append(Solution(labels=[c.label for c in chosen], score=sum(c.score for c in chosen), totals=totals,
                              achieved={limit.field: limit.describe(totals[limit.resource]) for limit in limits}))
    return found


def pareto(slots: list[list[Candidate]], fixed: Price, target: Target, parent: Price,
           points: int = 12) -> list[dict[str, float]]:
    """Best score at evenly spaced decode speed-ups from 1x to the fastest child the library allows."""
    fastest = _milp(slots, fixed, target, [], lambda c: c.price.decode_s, [], 1.0)
    assert fastest is not None, "without limits every library has a child"
    top = parent.decode_s / _totals(fastest, fixed, target)["decode_s"]
    front = []
    for step in range(points):
        ratio = 1.0 + (top - 1.0) * step / (points - 1)
        swept = target.model_copy(update={"throughput": ratio * (1 - 1e-9), "latency": None, "memory_gib": None,
                                          "params": None, "active_params": None})
        best = solve(slots, fixed, swept, limits_for(swept, parent))[0]
        front.append({"throughput": parent.decode_s / best.totals["decode_s"], "kl": best.score,
                      "params": best.totals["params"] / parent.params})
    return front
