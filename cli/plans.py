"""How a stage command reads its build plan (`--plan`, what the operator's Jobs pass) and hands back its
result: as the termination message (`--result-file`) and as a file on the artifacts claim, which outlives
the pod."""

from __future__ import annotations

from pathlib import Path

from tailor.compressor.buildplan import BuildPlan, Stage
from tailor.compressor.results import StageResult, write_result


def write_results(result: StageResult, result_file: Path | None, plan: BuildPlan | None, stage: Stage) -> None:
    if plan is not None:
        write_result(result, Path(plan.layout.result(stage)))
    if result_file is not None:
        write_result(result, result_file)


def needs(args: object, *flags: str) -> None:
    """Without --plan, these flags are required."""
    missing = [f"--{flag.replace('_', '-')}" for flag in flags if getattr(args, flag) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} required without --plan")
