"""The plan format: strict fields, clear errors, Iterative Puzzle's per-round targets, no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tailor.compressor.puzzle.plan import Plan, PlanError

EXAMPLES = sorted((Path(__file__).resolve().parents[4] / "examples" / "plans").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_example_plans_load(path: Path) -> None:
    assert Plan.load(path).target.throughput is not None


def test_a_misspelt_field_is_named(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"target.througput: Extra inputs are not permitted"):
        Plan.load(write(tmp_path, "target: {througput: 1.5}\n"))


def test_a_target_needs_a_limit(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="set at least one of throughput"):
        Plan.load(write(tmp_path, "target: {gpu: cpu}\n"))


def test_a_bad_value_names_its_field(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"target.throughput: Input should be greater than or equal to 1"):
        Plan.load(write(tmp_path, "target: {throughput: 0.5}\n"))


def test_unreadable_and_non_mapping_plans(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read the plan"):
        Plan.load(tmp_path / "missing.yaml")
    with pytest.raises(PlanError, match="expected a mapping"):
        Plan.load(write(tmp_path, "- 1\n"))
    with pytest.raises(PlanError, match="not valid YAML"):
        Plan.load(write(tmp_path, "target: {a: [\n"))


def test_rounds_split_every_ratio_geometrically() -> None:
    plan = Plan.model_validate({"target": {"throughput": 2.0, "params": 0.5, "memoryGiB": 1.0}, "rounds": 2})
    first, last = plan.round_targets(parent_memory_gib=4.0)
    assert first.throughput == pytest.approx(2**0.5) and last.throughput == pytest.approx(2.0)
    assert first.params == pytest.approx(0.5**0.5) and last.params == pytest.approx(0.5)
    assert first.memory_gib == pytest.approx(2.0) and last.memory_gib == pytest.approx(1.0)


def test_the_plan_imports_without_torch() -> None:
    code = "import sys, tailor.compressor.puzzle.plan, tailor.compressor.puzzle.search; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
