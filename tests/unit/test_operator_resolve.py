"""From a CompressedModel spec to its build plan: the Puzzle plan (checked by the compressor's Plan), the
resolved precision and KV cache, the layout on the claim, results that fit a termination message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tailor.compressor.buildplan import BuildPlan
from tailor.compressor.hardware import GpuCatalog, Precision
from tailor.compressor.puzzle.plan import Target
from tailor.compressor.results import TERMINATION_MESSAGE_BYTES, CompressResult, pack_config, unpack_config
from tailor.operator.api import CompressedModel
from tailor.operator.resolve import InvalidPlan, compression_plan, fingerprint, resolve

REPO = Path(__file__).resolve().parents[2]
CATALOG = GpuCatalog.load()


def example(**compression: Any) -> CompressedModel:
    body = yaml.safe_load((REPO / "examples" / "nemotron-super-h100.yaml").read_text())
    body["spec"]["compression"].update(compression)
    return CompressedModel.model_validate(body)


OWNER = {"metadata": {"name": "m", "namespace": "ns", "uid": "1a2b3c4d-0000"}}


def test_the_h100_example_becomes_a_plan_with_absolute_caps_and_a_memory_budget() -> None:
    spec = example(latencyFactor=0.5, throughputFactor=1.5, batch=8, requestTokensPerSecond=100).spec
    plan = compression_plan(spec, Precision.NVFP4)
    target = plan.model_dump(by_alias=True, exclude_none=True)["target"]
    assert target == {"gpu": "H100-80GB", "precision": "nvfp4", "kvDtype": "bf16", "batch": 8, "context": 1_000_000,
                      "throughput": 2.0,  # per-token latency x0.5 at the batch is 2x decode throughput
                      "requestTokensPerSecond": 100.0,  # Puzzle's per-user floor at that batch
                      "memoryGiB": 78.0, "paramsBillions": 76, "activeParamsBillions": 9.5, "costs": "auto"}
    assert plan.parent == "hf://nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16"
    assert plan.rounds == 3 and plan.gkd.tokens == 4_000_000_000


def test_plan_overrides_merge_and_unknown_fields_fail_with_the_field() -> None:
    spec = example(planOverrides={"library": {"ffnWidths": [0.5]}, "evalTokens": 64}).spec
    plan = compression_plan(spec, Precision.NVFP4)
    assert plan.library.ffn_widths == [0.5] and plan.library.no_op is True and plan.eval_tokens == 64
    with pytest.raises(InvalidPlan, match=r"library\.ffnWidth"):
        compression_plan(example(planOverrides={"library": {"ffnWidth": [0.5]}}).spec, Precision.NVFP4)


def test_auto_is_resolved_once_for_the_target_and_the_plan_says_so() -> None:
    body = yaml.safe_load((REPO / "examples" / "nemotron-super-h100.yaml").read_text())
    body["spec"]["quantization"] = {"precision": "auto", "kvCacheDtype": "auto"}
    hopper = resolve(CompressedModel.model_validate(body).spec, OWNER, 2, CATALOG)
    assert (hopper.precision, hopper.kv_cache_dtype.value) == (Precision.FP8, "fp8")
    assert hopper.quantize is not None and hopper.quantize.format == "fp8"  # never `auto` to a Job
    assert hopper.puzzle.target.precision is Precision.FP8
    body["spec"]["compression"]["targetGPU"] = "B200-180GB"
    assert resolve(CompressedModel.model_validate(body).spec, OWNER, 2, CATALOG).precision is Precision.NVFP4
    body["spec"]["compression"]["targetGPU"] = "A100-80GB"
    ampere = resolve(CompressedModel.model_validate(body).spec, OWNER, 2, CATALOG)
    assert ampere.precision is Precision.BF16 and ampere.quantize is None and ampere.stages == ("compress",
                                                                                                   "evaluate")
    assert ampere.checkpoint == "/artifacts/m-1a2b3c4d/g2/compress/child"
    assert BuildPlan.model_validate(yaml.safe_load(hopper.dump())) == hopper  # what the ConfigMap carries


def test_absolute_parameter_caps_become_shares_of_the_parent() -> None:
    target = Target(gpu="H100", throughput=None, params_billions=75.3, active_params_billions=30)
    resolved = target.for_parent(total=120_700_000_000, active=12_800_000_000)
    assert resolved.params == pytest.approx(75.3 / 120.7)
    assert resolved.active_params is None  # the parent already has fewer than 30B active
    assert resolved.params_billions is None and resolved.active_params_billions is None


def test_the_layout_and_what_changes_the_build() -> None:
    spec = example().spec
    plan = resolve(spec, OWNER, 2, CATALOG)
    assert (plan.layout.child, plan.layout.quantized, plan.checkpoint) == (
        "/artifacts/m-1a2b3c4d/g2/compress/child", "/artifacts/m-1a2b3c4d/g2/quantized",
        "/artifacts/m-1a2b3c4d/g2/quantized")
    assert plan.layout.package(3, "h100") == "m-1a2b3c4d/g3/triton-h100"
    assert plan.layout.result("compress") == "/artifacts/m-1a2b3c4d/g2/results/compress.json"
    cpu = CompressedModel.model_validate({"apiVersion": "tailor.dev/v1alpha1", "kind": "CompressedModel", "spec": {
        "source": {"uri": "pvc://models/toy"}, "compression": {"targetGPU": "cpu", "throughputFactor": 1.2}}})
    toy = resolve(cpu.spec, OWNER, 1, CATALOG)
    assert toy.quantize is None and toy.parent == "/source/toy"  # auto on a device without FP8: BF16 served
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


def test_a_build_keeps_its_own_and_the_serving_generations_folders_only(tmp_path: Path) -> None:
    body = yaml.safe_load((REPO / "examples" / "nemotron-super-h100.yaml").read_text())
    plan = resolve(CompressedModel.model_validate(body).spec, OWNER, 5, CATALOG, serving=3)
    assert plan.layout.keep == [3]
    folder = tmp_path / plan.layout.folder
    for name in ("g1", "g3", "g4", "g5", "g10", "grafana"):
        (folder / name / "x").mkdir(parents=True)
    (tmp_path / "m-ffffffff" / "g1").mkdir(parents=True)  # another object's folder
    removed = plan.layout.model_copy(update={"root": str(tmp_path)}).prune()
    assert sorted(p.name for p in removed) == ["g1", "g10", "g4"]
    assert sorted(p.name for p in folder.iterdir()) == ["g3", "g5", "grafana"]
    assert (tmp_path / "m-ffffffff" / "g1").is_dir()


def test_tailor_result_hands_back_a_stage_result_from_the_claim(tmp_path: Path) -> None:
    """What a reader Job runs when a finished stage's pod is gone."""
    from tailor.cli.main import main

    body = yaml.safe_load((REPO / "examples" / "nemotron-super-h100.yaml").read_text())
    plan = resolve(CompressedModel.model_validate(body).spec, OWNER, 2, CATALOG)
    plan = plan.model_copy(update={"layout": plan.layout.model_copy(update={"root": str(tmp_path)})})
    (tmp_path / "plan.yaml").write_text(plan.dump())
    args = ["result", "--plan", str(tmp_path / "plan.yaml"), "--stage", "compress", "--result-file",
            str(tmp_path / "termination-log")]
    assert main(args) == 1  # nothing on the claim yet: an error naming the file
    saved = Path(plan.layout.result("compress"))
    saved.parent.mkdir(parents=True)
    saved.write_text('{"stage": "compress"}')
    assert main(args) == 1  # not a compress result
    result = CompressResult(child="/x", params=2, active_params=1, parent_params=4, parent_active_params=2,
                            pattern="M*", predicted_speedup=2.0, kl_to_parent=0.1, config=pack_config({"a": 1}))
    saved.write_text(result.message())
    assert main(args) == 0
    assert (tmp_path / "termination-log").read_text() == result.message()
