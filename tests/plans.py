"""Compression plans that run the pipeline on the tiny parents of tests/conftest.py in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def tiny_plan(parent: Path, **changes: Any) -> dict[str, Any]:
    plan: dict[str, Any] = {
        "parent": str(parent), "data": {"seqLen": 64},
        "target": {"gpu": "cpu", "throughput": 1.04, "context": 128, "costs": "roofline"},
        "bld": {"tokens": 1024, "lr": 0.001, "batch": 4}, "bldActivationTokens": 512,
        "scoringTokens": 256, "evalTokens": 256, "gkd": {"tokens": 512, "lr": 0.0001, "batch": 4},
        "measureTokens": 4,
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(plan.get(key), dict):
            plan[key] = {**plan[key], **value}
        else:
            plan[key] = value
    return plan


def write_plan(folder: Path, plan: dict[str, Any]) -> Path:
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path
