"""From a CompressedModel spec to the stage commands: the compression plan (checked by the compressor's Plan),
stage arguments, results that fit a termination message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tailor.compressor.hardware import GpuCatalog
from tailor.compressor.puzzle.plan import Plan, Target
from tailor.compressor.results import TERMINATION_MESSAGE_BYTES, CompressResult, pack_config, unpack_config
from tailor.operator.api import CompressedModel
from tailor.operator.stages import (
    InvalidPlan,
    compression_plan,
    evaluate_args,
    fingerprint,
    job_env,
    quantize_args,
    quantizes,
)

REPO = Path(__file__).resolve().parents[2]
CATALOG = GpuCatalog.load()


def example(**compression: Any) -> CompressedModel:
    body = yaml.safe_load((REPO / "examples" / "nemotron-super-h100.yaml").read_text())
    body["spec"]["compression"].update(compression)
    return CompressedModel.model_validate(body)


def test_the_h100_example_becomes_a_plan_with_absolute_caps_and_a_memory_budget() -> None:
    spec = example(latencyFactor=0.5, throughputFactor=1.5, batch=8).spec
    plan = compression_plan(spec, CATALOG)
    target = plan["target"]
    assert target == {"gpu": "H100-80GB", "precision": "nvfp4", "batch": 8, "context": 1_000_000,
                      "throughput": 2.0,  # per-token latency x0.5 at the batch is 2x decode throughput
                      "memoryGiB": 78.0, "paramsBillions": 76, "activeParamsBillions": 9.5}
    assert plan["parent"] == "hf://nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16"
    assert plan["rounds"] == 3 and plan["gkd"]["tokens"] == 4_000_000_000
    Plan.model_validate(plan)  # what the Job will load


def test_plan_overrides_merge_and_unknown_fields_fail_with_the_field() -> None:
    spec = example(planOverrides={"library": {"ffnWidths": [0.5]}, "evalTokens": 64}).spec
    plan = Plan.model_validate(compression_plan(spec, CATALOG))
    assert plan.library.ffn_widths == [0.5] and plan.library.linear is True and plan.eval_tokens == 64
    with pytest.raises(InvalidPlan, match=r"library\.ffnWidth"):
        compression_plan(example(planOverrides={"library": {"ffnWidth": [0.5]}}).spec, CATALOG)


def test_absolute_parameter_caps_become_shares_of_the_parent() -> None:
    target = Target(gpu="H100", throughput=None, params_billions=75.3, active_params_billions=30)
    resolved = target.for_parent(total=120_700_000_000, active=12_800_000_000)
    assert resolved.params == pytest.approx(75.3 / 120.7)
    assert resolved.active_params is None  # the parent already has fewer than 30B active
    assert resolved.params_billions is None and resolved.active_params_billions is None


def test_stage_arguments_and_what_changes_the_build() -> None:
    spec = example().spec
    assert quantizes(spec, CATALOG)
    args = quantize_args(spec, "m-1a2b3c4d", 2, CATALOG)
    assert args[:5] == ["quantize", "--model", "/artifacts/m-1a2b3c4d/g2/compress/child", "--out",
                        "/artifacts/m-1a2b3c4d/g2/quantized"]
    assert args[args.index("--format") + 1] == "nvfp4" and args[args.index("--kv-cache") + 1] == "fp8"
    assert evaluate_args(spec, "m-1a2b3c4d", 2, CATALOG)[2] == "/artifacts/m-1a2b3c4d/g2/quantized"
    cpu = CompressedModel.model_validate({"apiVersion": "tailor.dev/v1alpha1", "kind": "CompressedModel", "spec": {
        "source": {"uri": "pvc://models/toy"}, "compression": {"targetGPU": "cpu", "throughputFactor": 1.2}}})
    assert not quantizes(cpu.spec, CATALOG)  # auto on a device without FP8: the BF16 child is served
    assert evaluate_args(cpu.spec, "m-1a2b3c4d", 1, CATALOG)[2] == "/artifacts/m-1a2b3c4d/g1/compress/child"
    base = fingerprint(spec)
    assert fingerprint(example().spec.model_copy(update={"deployment": None})) == base
    assert fingerprint(example(rounds=2).spec) != base


def test_the_75b_child_config_fits_a_termination_message() -> None:
    config = json.loads((REPO / "compressor" / "models" / "nemotron-3-puzzle-75b-a9b.json").read_text())
    result = CompressResult(child="/artifacts/nemotron-super-h100/g1/compress/child", params=75_350_000_000,
                            active_params=9_310_000_000, parent_params=120_670_000_000,
                            parent_active_params=12_770_000_000, pattern="M" * 88, predicted_speedup=2.0,
                            kl_to_parent=0.1, config=pack_config(config))
    assert len(result.message().encode()) < TERMINATION_MESSAGE_BYTES / 2
    assert unpack_config(CompressResult.model_validate_json(result.message()).config) == config
    with pytest.raises(ValueError, match="termination message holds 4096"):
        result.model_copy(update={"pattern": "M" * 5000}).message()


def test_stage_jobs_cache_downloads_on_the_claim_and_read_the_source_credentials() -> None:
    env = {e["name"]: e for e in job_env(example().spec)}
    assert env["TAILOR_CACHE_DIR"]["value"] == "/artifacts/.cache"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN", "optional": True}


def test_an_hf_parent_that_cannot_be_downloaded_names_the_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tailor.compressor.puzzle.pipeline import resolve_parent

    monkeypatch.setenv("TAILOR_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"hf://tailor-tests/no-such-model@v0: cannot download the parent"):
        resolve_parent("hf://tailor-tests/no-such-model@v0")
    with pytest.raises(ValueError, match="s3:// parents are not supported"):
        resolve_parent("s3://bucket/model")
