"""The run's report: `report.json` (this model) and a short Markdown summary, written last."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from tailor.compressor.compute import Compute
from tailor.compressor.puzzle.evaluate import Quality
from tailor.compressor.results import CompressResult, pack_config


class ModelFigures(BaseModel):
    params: int
    active_params: int
    weight_bytes: int  # under the target precision's recipe
    pattern: str  # one code per sub-layer: * attention, M Mamba, - MLP, E MoE, L linear, 0 removed
    quality: Quality
    decode_tokens_per_second: float | None  # None: the model does not fit budgetGiB whole


class RoundSummary(BaseModel):
    round: int
    target: dict[str, float | None]
    achieved: dict[str, str]
    score: float  # sum of the chosen variants' replace-1-block KLs
    alternatives: list[float]  # scores of the further distinct solutions
    predicted_speedup: float  # decode, the search's cost model, of the assembled child over the parent
    measured_speedup: float | None  # the same, timed in paired steps after assembly (measured costs only): median
    measured_speedup_range: list[float] | None = None  # the pairs' lowest and highest
    searches: int  # 1, or more when the measured speed-up missed the prediction and costs were timed again
    gkd_loss_first: float
    gkd_loss_last: float
    bld_nmse_median: float


class Report(BaseModel):
    plan: dict[str, object]
    parent: ModelFigures
    child: ModelFigures
    cost_source: str
    predicted_speedup: float  # decode, from the search's cost model
    measured_speedup: float | None  # decode, same harness for both; None where not measured
    measured_on: str  # where and at what workload the measured figures were taken
    compute: Compute  # the dtype every stage computed in, and why (`compute.resolve`)
    kl_to_parent: float
    perplexity_ratio: float
    blocks: list[dict[str, str]]  # per layer: its mixer and FFN choices (`library.part_label`), "" where absent
    rounds: list[RoundSummary]
    stage_seconds: dict[str, float]
    wall_seconds: float

    def markdown(self) -> str:
        p, c = self.parent, self.child
        lines = [
            "# Compression report", "",
            "| | parent | child | child / parent |", "| --- | --- | --- | --- |",
            f"| parameters | {p.params:,} | {c.params:,} | {c.params / p.params:.3f} |",
            f"| active parameters | {p.active_params:,} | {c.active_params:,} | "
            f"{c.active_params / p.active_params:.3f} |",
            f"| weight bytes | {p.weight_bytes:,} | {c.weight_bytes:,} | {c.weight_bytes / p.weight_bytes:.3f} |",
            f"| held-out perplexity | {p.quality.perplexity:.3f} | {c.quality.perplexity:.3f} | "
            f"{self.perplexity_ratio:.3f} |",
            f"| decode tokens/s (measured) | {_figure(p.decode_tokens_per_second, '.1f')} | "
            f"{_figure(c.decode_tokens_per_second, '.1f')} | {_figure(self.measured_speedup, '.3f')} |", "",
            f"Measured on {self.measured_on}. Computed in {self.compute.describe()}.", "",
            f"KL(parent || child): {self.kl_to_parent:.4f} nats/token. Predicted decode speed-up "
            f"({self.cost_source} costs): {self.predicted_speedup:.3f}x.", "",
            f"Pattern (* attention, M Mamba, - MLP, E MoE; L linear, 0 removed): `{c.pattern}`", "",
            "| round | achieved | score | speed-up predicted / measured (median, range of paired steps) | searches "
            "| GKD loss first -> last |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in self.rounds:
            achieved = ", ".join(f"{k} {v}" for k, v in r.achieved.items())
            losses = f"{r.gkd_loss_first:.4f} -> {r.gkd_loss_last:.4f}"
            spread = f" ({r.measured_speedup_range[0]:.3f}-{r.measured_speedup_range[1]:.3f})" \
                if r.measured_speedup_range else ""
            speed = f"{r.predicted_speedup:.3f}x / {_figure(r.measured_speedup, '.3f')}{spread}"
            lines.append(f"| {r.round} | {achieved} | {r.score:.4f} | {speed} | {r.searches} | {losses} |")
        lines += ["", "| layer | mixer | FFN |", "| --- | --- | --- |"]
        lines += [f"| {i} | {b['mixer'] or '-'} | {b['ffn'] or '-'} |" for i, b in enumerate(self.blocks)]
        lines += ["", "| stage | seconds |", "| --- | --- |"]
        lines += [f"| {name} | {seconds:.1f} |" for name, seconds in self.stage_seconds.items()]
        lines += ["", f"Wall time: {self.wall_seconds:.1f} s.", ""]
        return "\n".join(lines)


def compress_result(report: Report, child: Path) -> CompressResult:
    """The short form the operator reads from the Job: sizes, and the child's config.json to size it by."""
    return CompressResult(child=str(child), params=report.child.params, active_params=report.child.active_params,
                          parent_params=report.parent.params, parent_active_params=report.parent.active_params,
                          pattern=report.child.pattern, predicted_speedup=report.predicted_speedup,
                          measured_speedup=report.measured_speedup,
                          kl_to_parent=report.kl_to_parent, compute=report.compute.describe(),
                          config=pack_config(json.loads((child / "config.json").read_text())))


def _figure(value: float | None, spec: str) -> str:
    return "not measured" if value is None else format(value, spec)
