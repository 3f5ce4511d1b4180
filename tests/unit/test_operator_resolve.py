"""From a CompressedModel spec to its build plan: the Puzzle plan (checked by the compressor's Plan), the
resolved precision and KV cache, the layout on the claim, results that fit a termination message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tailor.compressor.buildplan import BuildPlan
from tailor.compressor.model.architecture import MODELS_DIR
from tailor.compressor.puzzle.plan import Corpus, Target
from tailor.compressor.results import TERMINATION_MESSAGE_BYTES, CompressResult, pack_config, unpack_config
from tailor.compressor.sizing.hardware import GpuCatalog, Precision
from tailor.operator.api import CompressedModel, CompressedModelSpec
from tailor.operator.resolve import InvalidPlan, TargetBatch, compression_plan, fingerprint, resolve, target_batch

from fakekube import ready_nodes

REPO = Path(__file__).resolve().parents[2]
CATALOG = GpuCatalog.load()
NODES = ready_nodes()  # the devcluster's pools: h100 2 nodes x 8 GPUs, a100 2 x 4, l40s 1 x 2, ...
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
A100 = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}
L40S = {"nvidia.com/gpu.product": "NVIDIA-L40S"}


def example(**compression: Any) -> CompressedModel:
    body = yaml.safe_load((REPO / "examples" / "nemotron-super-h100.yaml").read_text())
    body["spec"]["compression"].update(compression)
    return CompressedModel.model_validate(body)


def serving_on(*pools: tuple[str, dict[str, str], dict[str, int]], precision: str = "none",
               **compression: Any) -> CompressedModelSpec:
    """The H100 example served on `pools`: (name, nodeSelector, concurrency); BF16 unless `precision` says, so
    any pool's GPUs can serve it."""
    body = example(**compression).model_dump(by_alias=True, exclude_none=True)
    body["spec"]["quantization"]["precision"] = precision
    body["spec"]["deployment"]["pools"] = [{"name": name, "nodeSelector": selector, "concurrency": concurrency}
                                           for name, selector, concurrency in pools]
    return CompressedModel.model_validate(body).spec


OWNER = {"metadata": {"name": "m", "namespace": "ns", "uid": "1a2b3c4d-0000"}}


def test_the_h100_example_becomes_a_plan_with_absolute_caps_and_a_memory_budget() -> None:
    spec = example(latencyFactor=0.5, throughputFactor=1.5, batch=8, requestTokensPerSecond=100).spec
    plan = compression_plan(spec, target_batch(spec, [], CATALOG).value, Precision.NVFP4)
    target = plan.model_dump(by_alias=True, exclude_none=True)["target"]
    assert target == {"gpu": "H100-80GB", "precision": "nvfp4", "kvDtype": "bf16", "batch": 8, "context": 1_000_000,
                      "throughput": 2.0,  # per-token latency x0.5 at the batch is 2x decode throughput
                      "requestTokensPerSecond": 100.0,  # Puzzle's per-user floor at that batch
                      "memoryGiB": 78.0, "paramsBillions": 76, "activeParamsBillions": 9.5, "costs": "auto"}
    assert plan.parent == "hf://nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16"
    assert plan.rounds == 3 and plan.gkd.tokens == 4_000_000_000


def test_plan_overrides_merge_and_unknown_fields_fail_with_the_field() -> None:
    spec = example(planOverrides={"library": {"ffnWidths": [0.5]}, "evalTokens": 64}).spec
    plan = compression_plan(spec, 1, Precision.NVFP4)
    assert plan.library.ffn_widths == [0.5] and plan.library.no_op is True and plan.eval_tokens == 64
    with pytest.raises(InvalidPlan, match=r"library\.ffnWidth"):
        compression_plan(example(planOverrides={"library": {"ffnWidth": [0.5]}}).spec, 1, Precision.NVFP4)
    with pytest.raises(ValidationError, match=r"target\.batch is set from spec\.compression\.batch or spec\.deploy"):
        example(planOverrides={"target": {"batch": 64}})  # what the spec decides: refused with the spec


def test_the_batch_is_what_the_pools_ask_of_each_gpu_of_their_nodes() -> None:
    # the example's h100 pool: perNode 64 over 8 GPUs per node, the 8 requests per H100 of its memory budget
    assert target_batch(example().spec, NODES, CATALOG) == TargetBatch(value=8,
                                                                       source="pool h100 (perNode 64 over 8 GPUs)")
    assert target_batch(serving_on(("h100", H100, {"perNode": 20})), NODES, CATALOG).value == 3  # 2.5, rounded up
    total = target_batch(serving_on(("a100", A100, {"total": 20})), NODES, CATALOG)
    assert total == TargetBatch(value=3, source="pool a100 (total 20 over 2 node(s) x 4 GPUs)")  # 2.5 per GPU
    # only Ready, schedulable nodes with GPUs count, as when the pool is sized: half the nodes, twice the ask
    h100s = [n for n in NODES if n["metadata"]["labels"].get("nvidia.com/gpu.product") == H100[
        "nvidia.com/gpu.product"]]
    cordoned = [{**n, "spec": {"unschedulable": True}} if n is h100s[0] else n for n in NODES]
    assert target_batch(serving_on(("h100", H100, {"total": 64})), NODES, CATALOG).value == 4
    assert target_batch(serving_on(("h100", H100, {"total": 64})), cordoned, CATALOG).value == 8
    # the plan's memory and throughput constraints are computed at it
    spec = example().spec
    assert compression_plan(spec, target_batch(spec, NODES, CATALOG).value, Precision.NVFP4).target.batch == 8


def test_the_batch_is_the_most_any_pool_asks_of_a_gpu() -> None:
    spec = serving_on(("h100", H100, {"perNode": 24}), ("a100", A100, {"total": 40}), ("l40s", L40S, {"perNode": 8}),
                      ("gone", {"pool": "none"}, {"perNode": 4096}))
    gone = "gone (no node matches nodeSelector {'pool': 'none'})"
    assert target_batch(spec, NODES, CATALOG) == TargetBatch(  # 3, 5 and 4 per GPU; no node to divide 4096 over
        value=5, left_out=(gone,), source=f"pool a100 (total 40 over 2 node(s) x 4 GPUs); left out: {gone}")


def test_a_pool_that_cannot_serve_the_build_does_not_set_its_batch() -> None:
    pools = (("h100", H100, {"perNode": 24}), ("a100", A100, {"total": 40}))  # 3 and 5 per GPU
    fp8 = target_batch(serving_on(*pools, precision="fp8"), NODES, CATALOG)  # A100 has no FP8 math
    assert fp8.value == 3 and fp8.left_out == ("a100 (A100-40GB (ampere) has no FP8 math: it cannot serve the fp8 "
                                               "checkpoint)",)
    assert target_batch(serving_on(*pools), NODES, CATALOG).value == 5  # BF16: both serve it


def test_an_explicit_batch_wins_and_without_nodes_or_pools_the_batch_is_1() -> None:
    assert target_batch(example(batch=2).spec, NODES, CATALOG) == TargetBatch(value=2, source="spec.compression.batch")
    assert target_batch(example(batch=1).spec, [], CATALOG).value == 1
    unknown = target_batch(example().spec, [], CATALOG)
    assert unknown.value == 1 and unknown.left_out == ("h100 (no node matches nodeSelector {'nvidia.com/gpu.product': "
                                                       "'NVIDIA-H100-80GB-HBM3'})",)
    assert "set spec.compression.batch" in unknown.source
    assert target_batch(example().spec.model_copy(update={"deployment": None}), NODES, CATALOG).value == 1
    with pytest.raises(InvalidPlan, match="pool l40s asks 250000 concurrent requests per GPU"):
        target_batch(serving_on(("l40s", L40S, {"total": 500_000})), NODES, CATALOG)  # above Puzzle's 4096


def test_auto_is_resolved_once_for_the_target_and_the_plan_says_so() -> None:
    body = yaml.safe_load((REPO / "examples" / "nemotron-super-h100.yaml").read_text())
    body["spec"]["quantization"] = {"precision": "auto", "kvCacheDtype": "auto"}
    hopper = resolve(CompressedModel.model_validate(body).spec, OWNER, 2, CATALOG, 1)
    assert (hopper.precision, hopper.kv_cache_dtype.value) == (Precision.FP8, "fp8")
    assert hopper.quantize is not None and hopper.quantize.format == "fp8"  # never `auto` to a Job
    assert hopper.puzzle.target.precision is Precision.FP8
    body["spec"]["compression"]["targetGPU"] = "B200-180GB"
    assert resolve(CompressedModel.model_validate(body).spec, OWNER, 2, CATALOG, 1).precision is Precision.NVFP4
    body["spec"]["compression"]["targetGPU"] = "A100-80GB"
    ampere = resolve(CompressedModel.model_validate(body).spec, OWNER, 2, CATALOG, 1)
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
    plan = resolve(spec, OWNER, 2, CATALOG, 1)
    assert (plan.layout.child, plan.layout.quantized, plan.checkpoint) == (
        "/artifacts/m-1a2b3c4d/g2/compress/child", "/artifacts/m-1a2b3c4d/g2/quantized",
        "/artifacts/m-1a2b3c4d/g2/quantized")
    assert plan.layout.package(3, "h100") == "m-1a2b3c4d/g3/triton-h100"
    assert plan.layout.result("compress") == "/artifacts/m-1a2b3c4d/g2/results/compress.json"
    cpu = CompressedModel.model_validate({"apiVersion": "tailor.dev/v1alpha1", "kind": "CompressedModel", "spec": {
        "source": {"uri": "pvc://models/toy"}, "compression": {"targetGPU": "cpu", "throughputFactor": 1.2}}})
    toy = resolve(cpu.spec, OWNER, 1, CATALOG, 1)
    assert toy.quantize is None and toy.parent == "/source/toy"  # auto on a device without FP8: BF16 served
    base = fingerprint(spec)
    assert fingerprint(example().spec.model_copy(update={"deployment": None})) == base
    assert fingerprint(example(rounds=2).spec) != base


DATA = {"claimName": "corpora", "path": "legal/train/"}


def test_the_text_on_a_claim_becomes_the_plans_data_as_the_pods_see_it() -> None:
    plan = resolve(example(data={**DATA, "heldOutPath": "./legal/eval.jsonl", "textField": "body"}).spec, OWNER, 1,
                   CATALOG, 1)
    assert plan.puzzle.data.model_dump(by_alias=True) == {
        "text": "/data/legal/train", "heldout": "/data/legal/eval.jsonl", "textField": "body", "heldoutEvery": 8,
        "seqLen": 128}
    every = resolve(example(data={**DATA, "heldOutEvery": 4}).spec, OWNER, 1, CATALOG, 1).puzzle.data
    assert (every.heldout, every.heldout_every, every.text_field) == (None, 4, "text")
    assert resolve(example().spec, OWNER, 1, CATALOG, 1).puzzle.data.text == "broad"  # the demo default
    # the built-in text's held-out rule may be tuned; a claim's is spec.compression.data's
    tuned = compression_plan(example(planOverrides={"data": {"heldoutEvery": 4}}).spec, 1, Precision.NVFP4)
    assert tuned.data.heldout_every == 4
    with pytest.raises(ValidationError, match=r"data\.heldoutEvery is set from spec\.compression\.data\.heldOutEv"):
        example(data=DATA, planOverrides={"data": {"heldoutEvery": 4}})


def test_quantize_and_the_gate_read_the_text_of_the_plan_or_of_their_flags() -> None:
    from tailor.cli.main import build_parser
    from tailor.cli.plans import corpus

    plan = resolve(example(data={**DATA, "heldOutPath": "legal/eval"}).spec, OWNER, 1, CATALOG, 1)
    for stage in ("quantize", "evaluate"):
        assert corpus(build_parser().parse_args([stage, "--plan", "p.yaml"]), plan) == plan.puzzle.data
        with pytest.raises(ValueError, match="--heldout, --text-field: with --plan the text is the plan's data"):
            corpus(build_parser().parse_args([stage, "--plan", "p.yaml", "--heldout", "h", "--text-field", "b"]),
                   plan)
        flags = build_parser().parse_args([stage, "--text", "t", "--heldout", "h", "--text-field", "body"])
        assert corpus(flags, None) == Corpus(text="t", heldout="h", text_field="body")
        assert corpus(build_parser().parse_args([stage]), None) == Corpus()  # the built-in books, every 8th part


def test_new_text_is_a_new_build_and_no_text_keeps_the_fingerprint_of_before() -> None:
    plain = CompressedModelSpec.model_validate({"source": {"uri": "hf://org/parent"},
                                                "compression": {"targetGPU": "H100-80GB", "throughputFactor": 2}})
    assert fingerprint(plain, floor=True) == "e0169449a90c649a"  # as before spec.compression.data existed
    base = fingerprint(example().spec)
    with_data = fingerprint(example(data=DATA).spec)
    assert with_data != base
    assert fingerprint(example(data={**DATA, "path": "legal/train-v2"}).spec) != with_data
    assert fingerprint(example(data={**DATA, "heldOutPath": "legal/eval"}).spec) != with_data
    assert fingerprint(example(data={**DATA, "claimName": "corpora-v2"}).spec) != with_data


def test_the_75b_child_config_fits_a_termination_message() -> None:
    config = json.loads((MODELS_DIR / "nemotron-3-puzzle-75b-a9b.json").read_text())
    result = CompressResult(child="/artifacts/nemotron-super-h100/g1/compress/child", params=75_350_000_000,
                            active_params=9_310_000_000, parent_params=120_670_000_000,
                            parent_active_params=12_770_000_000, pattern="M" * 88, predicted_speedup=2.0,
                            kl_to_parent=0.1, config=pack_config(config))
    assert len(result.message().encode()) < TERMINATION_MESSAGE_BYTES / 2
    assert unpack_config(CompressResult.model_validate_json(result.message()).config) == config
    with pytest.raises(ValueError, match="termination message holds 4096"):
        result.model_copy(update={"pattern": "M" * 5000}).message()


def test_a_build_keeps_its_own_and_the_kept_generations_folders_only(tmp_path: Path) -> None:
    body = yaml.safe_load((REPO / "examples" / "nemotron-super-h100.yaml").read_text())
    plan = resolve(CompressedModel.model_validate(body).spec, OWNER, 5, CATALOG, 1, keep=[3])
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
    plan = resolve(CompressedModel.model_validate(body).spec, OWNER, 2, CATALOG, 1)
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


@pytest.mark.parametrize("example_file", sorted(p.name for p in (REPO / "examples").glob("*.yaml")))
def test_a_plan_reads_back_as_it_was_written(example_file: str) -> None:
    """The operator keeps each plan it writes by its text (`workloads.PLANS`) instead of parsing it again: that
    holds only because a plan's text reads back equal (the pools' package plans: test_operator_reconcile)."""
    body = yaml.safe_load((REPO / "examples" / example_file).read_text())
    body["metadata"] = OWNER["metadata"]
    spec = CompressedModelSpec.model_validate(body["spec"])
    plan = resolve(spec, body, 1, CATALOG, target_batch(spec, NODES, CATALOG).value)
    assert BuildPlan.parse(plan.dump()) == plan
    assert BuildPlan.parse(plan.dump()).dump() == plan.dump()


def test_the_floor_is_not_what_the_artifacts_depend_on() -> None:
    """A new minQualityRetention keeps the fingerprint (the gate is decided again, `decide.floor_plan`); builds
    recorded before it left the fingerprint are known by `floor=True`."""
    spec, raised = example().spec, example(minQualityRetention=0.99).spec
    assert fingerprint(raised) == fingerprint(spec)
    assert fingerprint(raised, floor=True) != fingerprint(spec, floor=True)
    assert fingerprint(spec, floor=True) != fingerprint(spec)
    assert fingerprint(example(rounds=2).spec) != fingerprint(spec)
