"""The operator's Prometheus metrics: reconciliation passes and their durations, objects by phase, and the
API requests made on each object's behalf. Served by `tailor operator --metrics-port`."""

from __future__ import annotations

from typing import get_args

from prometheus_client import Counter, Gauge, Histogram

from tailor.operator.api import Phase

RECONCILES = Counter("tailor_reconciles", "Reconciliation passes, by result (ok or error).", ["result"])
DURATION = Histogram("tailor_reconcile_duration_seconds", "Duration of one reconciliation pass.",
                     buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
PHASES = Gauge("tailor_compressedmodels", "CompressedModels this operator reconciles, by phase.", ["phase"])
API_REQUESTS = Counter("tailor_api_requests", "Kubernetes API requests made by reconciliation passes.")
PHASE_NAMES: tuple[str, ...] = get_args(Phase)

_phase_of: dict[str, str] = {}


def observe(uid: str, phase: str | None, seconds: float) -> None:
    DURATION.observe(seconds)
    _phase_of[uid] = phase or "Pending"
    _publish()


def forget(uid: str) -> None:
    _phase_of.pop(uid, None)
    _publish()


def _publish() -> None:
    for phase in PHASE_NAMES:
        PHASES.labels(phase=phase).set(sum(1 for p in _phase_of.values() if p == phase))
