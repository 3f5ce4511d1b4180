"""Every transition of the reconciler, on the dict-backed fake API (tests/fakekube.py): observe, decide and
execute run for real; the test plays the Job and Deployment controllers. Milliseconds a pass, no cluster,
no torch. The devcluster tests (tests/cluster/test_operator.py) run the same lifecycle on a real API server.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import gzip
import json
import math
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import yaml

from tailor.compressor.buildplan import BUILD_STAGES, DISTRIBUTED_STAGES, ONE_GPU_STAGES, PLAN_FILE, BuildPlan
from tailor.compressor.results import GateResult, PackageResult, QuantizeResult, SpeedResult, pack_config
from tailor.compressor.serving.codecheck import CODE_ENV
from tailor.compressor.sizing.engines import Engine
from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.devcluster.simulated import RESULT_ANNOTATION, SIMULATED, published_results
from tailor.operator import execute, handlers, names, workloads
from tailor.operator.api import SERVING_IMAGE, CompressedModelSpec, NodePoolTarget
from tailor.operator.decision import (
    PROGRESS_REQUEUE_S,
    QUEUED_REQUEUE_S,
    SETTLED_REQUEUE_S,
    WAITING_REQUEUE_S,
    Create,
    Decision,
)
from tailor.operator.deployment import SPEED_TOKENS_IN_FLIGHT, ServingIngress, ingress_policy, speed_sidecar
from tailor.operator.execute import MAX_DECIDE_TRIES, DecideFailed, reconcile
from tailor.operator.jobs import JobSettings, stage_job
from tailor.operator.manifest import job_finished, owned_by
from tailor.operator.observe import termination_messages
from tailor.operator.placement import gpu_terms
from tailor.operator.resolve import fingerprint
from tailor.operator.settings import OperatorSettings

from compressedmodels import H100, PRIVATE_PARENT, REPO, SETTINGS, builtin_super, manifest
from fakekube import FakeKube, ready_nodes


def give_claim(kube: FakeKube, name: str, to: str = "m") -> None:
    """A claim allowed for Tailor and shared with the object `to`, as its owner would give it."""
    kube.create("test", {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {
        "name": name, "namespace": "ns", "labels": {"tailor.dev/allowed": "true"},
        "annotations": {"tailor.dev/shared-with": to}}})


def step(kube: FakeKube, name: str = "m", settings: OperatorSettings = SETTINGS) -> Decision:
    decision = reconcile(kube, "ns", name, settings)
    assert decision is not None
    return decision


def controllers(kube: FakeKube, name: str = "m", revisions: bool = True) -> None:
    """Finish new Jobs (with their annotated results) and make new revisions available, as the Job and
    Deployment controllers would."""
    results = kube.model(name)["spec"]["jobs"]["podAnnotations"]
    for job in kube.names("Job"):
        if job_finished(kube.obj("Job", job)) is None:
            kube.finish_stage(job, results)
    for deployment in kube.names("Deployment"):
        if revisions and "status" not in kube.obj("Deployment", deployment):
            kube.make_available(deployment)


def drive(kube: FakeKube, until: str, name: str = "m", passes: int = 20, settings: OperatorSettings = SETTINGS
          ) -> Decision:
    """Passes, with the controllers between them, until the phase is `until`."""
    for _ in range(passes):
        decision = step(kube, name, settings)
        if decision.phase == until:
            return decision
        controllers(kube, name)
    raise AssertionError(f"{name} did not reach {until}: {kube.status(name)}")


def run(kube: FakeKube, passes: int, revisions: bool = True) -> Decision:
    """`passes` passes with the controllers between them."""
    for _ in range(passes):
        decision = step(kube)
        controllers(kube, revisions=revisions)
    return decision


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


def plan_of(kube: FakeKube, config_map: str) -> BuildPlan:
    return BuildPlan.model_validate(yaml.safe_load(kube.obj("ConfigMap", config_map)["data"]["plan.yaml"]))


# --- the lifecycle -----------------------------------------------------------------------------------------


def test_lifecycle_builds_once_sizes_from_the_result_and_serves(kube: FakeKube) -> None:
    kube.apply(manifest())
    assert step(kube).phase == "Compressing"
    assert kube.names("Job") == ["m-g1-compress"] and kube.names("PersistentVolumeClaim") == ["m-artifacts"]
    plan = plan_of(kube, "m-g1-plan")
    assert (plan.precision.value, plan.kv_cache_dtype.value, plan.target_product) == (
        "nvfp4", "fp8", "NVIDIA-H100-80GB-HBM3")
    command = kube.obj("Job", "m-g1-compress")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == ["tailor", "compress", "--plan", "/plan/plan.yaml", "--result-file", "/dev/termination-log"]
    ready = drive(kube, "Ready")
    status = ready.status
    assert status.build is not None and (status.build.precision, status.build.kv_cache_dtype) == ("nvfp4", "fp8")
    assert status.build.recipe == "nvfp4-mamba-moe" and status.build.target_product == "NVIDIA-H100-80GB-HBM3"
    h100, a100 = status.pools
    assert (h100.concurrency_per_gpu, h100.gpus_per_replica, h100.replicas, h100.revision) == (8, 1, 4, "g1")
    assert a100.skipped is not None and "no FP8 math" in a100.skipped
    assert kube.names("Job") == ["m-g1-compress", "m-g1-evaluate", "m-g1-package-h100", "m-g1-quantize",
                                 "m-g1-speed-h100"]
    package = plan_of(kube, "m-g1-package-h100")  # the pool's sizing travels in its plan: nothing re-derived
    assert package.pool is not None and package.pool.sizing.concurrency_per_replica == 8
    assert package.pool.gpu_profile == "H100-80GB" and package.pool.max_batch_size == 8
    assert (package.pool.engine, package.pool.quantized, h100.engine) == (Engine.VLLM, True, "vllm")
    # what each replica runs, as `kubectl get deploy -o yaml` shows it: NVIDIA's Triton vLLM image and the
    # engine arguments the package Job writes into model.json, from its plan (computed once, by the operator)
    revision = kube.obj("Deployment", "m-h100-g1")
    assert revision["spec"]["template"]["spec"]["containers"][0]["image"] == SERVING_IMAGE
    engine = json.loads(revision["metadata"]["annotations"]["tailor.dev/engine-args"])
    assert engine == package.pool.engine_args
    sizing = package.pool.sizing
    checkpoint = f"/models/{names.folder(kube.model('m'))}/g1/triton-h100/repository/m/1/checkpoint"  # mounted
    # 8 requests' KV and Mamba state in vLLM's pages (each Mamba state padded to an attention page of 6,272
    # tokens, the smallest multiple of 16 that holds one) and one page: 0.36% above the unpaged bytes
    reserved = engine.pop("kv_cache_memory_bytes")
    assert 8 * sizing.footprint.per_request <= reserved < 1.005 * 8 * sizing.footprint.per_request
    assert engine == {"model": checkpoint, "tokenizer": checkpoint, "dtype": "bfloat16", "max_model_len": 1_000_000,
                      "max_num_seqs": 8, "block_size": 6272, "tensor_parallel_size": 1, "kv_cache_dtype": "fp8",
                      "gpu_memory_utilization": round(sizing.footprint.usable / SETTINGS.catalog.get(
                          "H100-80GB").memory_bytes, 4), "enforce_eager": False, "trust_remote_code": True,
                      "enable_prefix_caching": False}
    containers = revision["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["triton", "openai"]  # the OpenAI-compatible API beside Triton
    assert {e.protocol for e in status.endpoints or []} == {"http", "grpc", "openai"}
    assert kube.obj("Service", "m-h100")["spec"]["selector"]["tailor.dev/revision"] == "g1"
    assert [s.state for s in status.stages] == ["Succeeded"] * 4
    assert {"JobCreated", "QualityGatePassed", "Ready"} <= {reason for _, reason, _ in kube.events}
    # the devcluster's canned results say so wherever a user looks: stage, condition, events
    assert [s.reason for s in status.stages[:3]] == ["Simulated"] * 3
    assert all("SIMULATED, not computed" in (s.message or "") for s in status.stages[:3])
    compressed = next(c for c in status.conditions if c.type == "Compressed")
    assert compressed.reason == "Simulated" and "kwok ended the pod" in compressed.message
    assert sum(reason == "SimulatedResult" for _, reason, _ in kube.events) == 3


def speed_result(**fields: Any) -> str:
    return SpeedResult(**{"gpu": "H100-80GB", "context": 1_000_000, "max_num_seqs": 16, "new_tokens": 64, "rounds": 2,
                          **fields}).message()


def test_the_speed_job_runs_triton_beside_tailor_speed_on_the_first_pool(kube: FakeKube) -> None:
    """Once serving, the first pool's speed Job: NVIDIA's Triton image on the parent and child packaged side by
    side (a native sidecar holding the pool's GPUs), `tailor speed` beside it in the same process namespace; the
    rollout is Ready without waiting for it."""
    kube.apply(manifest())
    ready = drive(kube, "Ready")
    assert ready.status.served_speedup is not None
    assert (ready.status.served_speedup.state, ready.status.served_speedup.job_name) == ("Running", "m-g1-speed-h100")
    assert ready.status.served_speedup.predicted == 2.0  # the compression's prediction, beside the measurement
    plan = plan_of(kube, "m-g1-package-h100")  # the Job reads the pool's plan, which asked for the pair
    assert plan.pool is not None and plan.pool.measure_speedup
    job = kube.obj("Job", "m-g1-speed-h100")
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] <= 2 * 3600
    assert pod["shareProcessNamespace"] and pod["nodeSelector"] == H100
    [triton], [speed] = pod["initContainers"], pod["containers"]
    assert (triton["restartPolicy"], triton["image"], triton["command"]) == ("Always", SERVING_IMAGE,
                                                                            ["tritonserver"])
    assert f"--model-repository=/models/{names.folder(kube.model('m'))}/g1/speed-h100/repository" in triton["args"]
    shm = 64 * 2**20 + 24 * SPEED_TOKENS_IN_FLIGHT  # its Python backend's /dev/shm
    assert triton["resources"]["limits"] == {  # 32 GiB assumed x 1.25, and its /dev/shm
        "nvidia.com/gpu": "1", "memory": f"{math.ceil((40 * 2**30 + shm) / 2**20)}Mi"}
    assert {"name": "artifacts", "mountPath": "/models", "readOnly": True} in triton["volumeMounts"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in triton["env"]
    assert speed["command"] == ["tailor", "speed", "--plan", "/plan/plan.yaml", "--http-port=8000",
                                "--grpc-port=8001", "--result-file", "/dev/termination-log"]
    assert "nvidia.com/gpu" not in speed["resources"]["requests"]
    # one GPU, no tensor-parallel workers: /dev/shm for its Python backend alone
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{math.ceil(shm / 2**20)}Mi"}} in pod[
        "volumes"]

    # kwok ended the pod with the devcluster's "not measured" result: said so, and still Ready
    controllers(kube)
    after = step(kube)
    assert after.phase == "Ready" and after.status.served_speedup is not None
    assert after.status.served_speedup.state == "NotMeasured"
    assert "simulated pool" in (after.status.served_speedup.message or "")
    assert "SpeedupNotMeasured" in [e.reason for e in after.events]


def test_a_tensor_parallel_speed_sidecar_gets_shared_memory() -> None:
    model = {"metadata": {"name": "m", "namespace": "ns", "uid": "uid-1"}}
    pool = NodePoolTarget(name="b200", node_selector={"pool": "b200"}, concurrency={"perNode": 8})
    job, *_ = stage_job(model, "speed", 1, JobSettings(image="runtime", gpus_per_node=0), {}, "claim",
                        "plan", pool="b200", sidecar=speed_sidecar(SERVING_IMAGE, "/models/r", 4, pool, None))
    pod = job["spec"]["template"]["spec"]
    (triton,) = pod["initContainers"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in triton["volumeMounts"]
    # 8 GiB for each of its 4 tensor-parallel workers, and its Python backend's 64 MiB and the speed requests'
    shm = 32 * 2**30 + 64 * 2**20 + 24 * SPEED_TOKENS_IN_FLIGHT
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{math.ceil(shm / 2**20)}Mi"}} in pod[
        "volumes"]
    assert triton["resources"]["limits"] == {"nvidia.com/gpu": "4",
                                             "memory": f"{math.ceil((4 * 40 * 2**30 + shm) / 2**20)}Mi"}  # + shm


def test_a_measured_speedup_goes_into_the_status_and_a_failed_one_says_why(kube: FakeKube) -> None:
    results = {**published_results(), RESULT_ANNOTATION.format(stage="speed"): speed_result(ratios=[
        {"concurrency": 1, "ratio": 1.81, "per_round": [1.8, 1.82], "contended": False},
        {"concurrency": 16, "ratio": 1.9, "per_round": [1.9, 1.9], "contended": True}])}
    kube.apply(manifest(results=results))
    drive(kube, "Ready")
    controllers(kube)
    served = step(kube).status.served_speedup
    assert served is not None and served.state == "Measured" and served.generation == 1 and served.pool == "h100"
    assert [(r.concurrency, r.ratio, r.per_round, r.contended) for r in served.ratios] == [
        (1, 1.81, [1.8, 1.82], False), (16, 1.9, [1.9, 1.9], True)]
    assert "1.81x at concurrency 1" in (served.message or "") and "predicted 2.00x" in (served.message or "")
    assert step(kube).status.served_speedup == served  # recorded once: the finished Job is not read again

    failing = FakeKube()
    failing.apply(manifest())
    drive(failing, "Ready")
    failing.finish_job("m-g1-speed-h100", "engine core died loading parent", failed="BackoffLimitExceeded")
    failed = step(failing)
    assert failed.phase == "Ready" and failed.status.served_speedup is not None
    assert failed.status.served_speedup.state == "Failed"
    assert "engine core died loading parent" in (failed.status.served_speedup.message or "")


def test_a_speedup_result_that_is_simulated_or_malformed_shows_no_figure(kube: FakeKube) -> None:
    simulated = speed_result(ratios=[{"concurrency": 1, "ratio": 9.0, "per_round": [9.0], "contended": False}],
                             simulated="canned")
    kube.apply(manifest(results={**published_results(), RESULT_ANNOTATION.format(stage="speed"): simulated}))
    drive(kube, "Ready")
    controllers(kube)
    served = step(kube).status.served_speedup
    assert served is not None and served.state == "Failed" and served.ratios == []


def test_without_measure_speedup_no_speed_job_runs(kube: FakeKube) -> None:
    kube.apply(manifest(measureSpeedup=False))
    ready = drive(kube, "Ready")
    run(kube, 2)
    assert ready.status.served_speedup is None and "m-g1-speed-h100" not in kube.names("Job")
    assert not plan_of(kube, "m-g1-package-h100").pool.measure_speedup  # type: ignore[union-attr]


def test_a_real_result_is_not_marked_simulated(kube: FakeKube) -> None:
    results = {key: json.dumps({**json.loads(value), "simulated": None}) for key, value in published_results().items()}
    results[RESULT_ANNOTATION.format(stage="package")] = PackageResult(code={"m/1/model.py": "0" * 64}).message()
    kube.apply(manifest(results=results))
    status = drive(kube, "Ready").status
    assert [s.reason for s in status.stages[:3]] == ["JobSucceeded"] * 3
    assert "SimulatedResult" not in {reason for _, reason, _ in kube.events}


def test_triton_checks_the_code_its_package_job_wrote(kube: FakeKube) -> None:
    """A real package Job hands back the digests of the code its repository runs: the operator records them and
    every Triton container of the pool's revision checks them before it starts (`codecheck`)."""
    kube.apply(manifest())
    drive(kube, "Evaluating")
    layout = BuildPlan.parse(kube.obj("ConfigMap", "m-g1-plan")["data"][PLAN_FILE]).layout
    folder = f"{layout.package(1, 'h100')}/repository/m"
    code = {f"{folder}/1/model.py": "a" * 64, f"{folder}/config.pbtxt": "b" * 64, "elsewhere/model.py": "c" * 64}
    results = kube.model("m")["spec"]["jobs"]["podAnnotations"]  # what the package Job's pod will say
    results[RESULT_ANNOTATION.format(stage="package")] = PackageResult(code=code).message()
    drive(kube, "Ready")
    (triton, *_) = kube.obj("Deployment", "m-h100-g1")["spec"]["template"]["spec"]["containers"]
    assert triton["command"][:2] == ["sh", "-c"] and triton["args"][1] == "tritonserver"
    assert {"name": CODE_ENV, "value": f"{'a' * 64}  {folder}/1/model.py\n{'b' * 64}  {folder}/config.pbtxt"} \
        in triton["env"], "the revision checks its own package's code, and only that"
    assert json.loads(kube.obj("ConfigMap", "m-g1-package-h100-code")["data"]["result"])["code"] == code


def test_a_package_job_that_ended_without_its_code_digests_is_run_again(kube: FakeKube) -> None:
    """Its pod went before its result was read (or an earlier operator made it): no revision runs unchecked
    code; the Job is made again."""
    results = {**published_results()}
    del results[RESULT_ANNOTATION.format(stage="package")]
    kube.apply(manifest(results=results))
    drive(kube, "Deploying")
    for _ in range(3):
        step(kube)
        controllers(kube)
    assert any(reason == "PackageRerun" for _, reason, _ in kube.events)
    assert not kube.names("Deployment") and "m-g1-package-h100-code" not in kube.names("ConfigMap")


def test_a_ready_object_writes_no_status_when_nothing_changed(kube: FakeKube) -> None:
    kube.apply(manifest())
    drive(kube, "Ready")
    writes = len(kube.writes)
    for _ in range(3):
        assert step(kube).phase == "Ready"
    assert kube.writes[writes:] == []  # no status patch, no create: the completion times stay as they were


def test_a_failed_job_fails_the_generation_and_a_new_generation_retries_the_build(kube: FakeKube) -> None:
    kube.apply(manifest())
    step(kube)
    kube.finish_job("m-g1-compress", "CUDA out of memory", failed="BackoffLimitExceeded")
    failed = step(kube)
    assert failed.phase == "Failed"
    condition = kube.condition("m", "Failed")
    assert condition["reason"] == "BackoffLimitExceeded" and "CUDA out of memory" in condition["message"]
    compress = next(s for s in kube.status("m")["stages"] if s["name"] == "Compress")
    assert compress["reason"] == "BackoffLimitExceeded"  # the reason is a field, never parsed from a message
    assert kube.condition("m", "Ready")["status"] == "False"
    kube.update_spec("m", {"jobs": {"backoffLimit": 3}})  # same build inputs, a new generation: retried
    assert step(kube).phase == "Compressing" and "m-g2-compress" in kube.names("Job")
    assert "m-g1-compress" not in kube.names("Job")  # a superseded generation's Job goes


def test_the_operator_decides_the_gate_from_the_scores_not_the_pods_verdict(kube: FakeKube) -> None:
    results = published_results()
    lying = GateResult(parent_score=0.60, child_score=0.30, retention=0.99, min_retention=0.1, passed=True,
                       parent_perplexity=5.0, child_perplexity=9.0, kl_to_parent=0.5, tokens=4096)
    results[RESULT_ANNOTATION.format(stage="evaluate")] = lying.message()
    kube.apply(manifest(results=results))
    failed = drive(kube, "Failed")
    assert kube.condition("m", "Failed")["reason"] == "QualityGateFailed"
    assert failed.status.quality is not None and failed.status.quality.retention == 0.5
    assert failed.status.quality.passed is False and not kube.names("Deployment")


def test_a_forged_gate_verdict_in_the_status_fails_as_the_record_says(kube: FakeKube) -> None:
    """Someone given compressedmodels/status marks a failed gate passed: the operator holds the status to its
    record of the evaluation (an immutable ConfigMap it made from the Job's result) and fails it again, deploying
    nothing."""
    results = published_results()
    results[RESULT_ANNOTATION.format(stage="evaluate")] = GateResult(
        parent_score=0.60, child_score=0.30, retention=0.5, min_retention=0.97, passed=False, parent_perplexity=5.0,
        child_perplexity=9.0, kl_to_parent=0.5, tokens=4096).message()
    kube.apply(manifest(results=results))
    drive(kube, "Failed")
    status = kube.status("m")
    forged = {"phase": "Evaluating", "conditions": [],
              "quality": {**status["quality"], "childScore": 0.6, "retention": 1.0, "passed": True},
              "stages": [{**stage, "state": "Succeeded", "reason": "JobSucceeded"} for stage in status["stages"]]}
    kube.patch("tenant", "CompressedModel", "ns", "m", {"status": forged})
    failed = drive(kube, "Failed")
    assert kube.condition("m", "Failed")["reason"] == "QualityGateFailed" and not kube.names("Deployment")
    assert failed.status.quality is not None and failed.status.quality.child_score == 0.30


def test_a_gate_forged_passed_before_its_job_ends_is_read_again(kube: FakeKube) -> None:
    """No record yet (the evaluation Job runs): a status that says it succeeded is not taken; the stage is read
    again from its Job, which has not ended, and nothing is packaged or deployed."""
    kube.apply(manifest())
    drive(kube, "Evaluating")
    status = kube.status("m")
    forged = {"quality": {"metric": "next_token_accuracy", "parentScore": 0.6, "childScore": 0.6, "retention": 1.0,
                          "minQualityRetention": 0.97, "passed": True},
              "stages": [{**stage, "state": "Succeeded"} for stage in status["stages"]]}
    kube.patch("tenant", "CompressedModel", "ns", "m", {"status": forged})
    assert step(kube).phase == "Evaluating"
    assert not [name for name in kube.names("Job") if "package" in name] and not kube.names("Deployment")
    assert next(s for s in kube.status("m")["stages"] if s["name"] == "Evaluate")["state"] == "Running"


def test_a_forged_build_in_the_status_is_put_back_as_recorded(kube: FakeKube) -> None:
    kube.apply(manifest())
    drive(kube, "Ready")
    recorded = kube.status("m")["build"]
    kube.patch("tenant", "CompressedModel", "ns", "m", {"status": {"build": {"childConfig": pack_config(LLAMA),
                                                                             "weightBytes": 1}}})
    step(kube)
    assert kube.status("m")["build"] == recorded
    assert any(reason == "StatusRestored" for _, reason, _ in kube.events)


def test_a_forged_fingerprint_does_not_pass_a_changed_spec_off_as_the_built_one(kube: FakeKube) -> None:
    """Someone given compressedmodels/status changes the build inputs and writes the new spec's fingerprint into
    status.build: the operator holds the fingerprint to the build's plan ConfigMap and builds the new spec."""
    kube.apply(manifest())
    drive(kube, "Ready")
    kube.update_spec("m", {"compression": {"rounds": 2}})
    changed = CompressedModelSpec.model_validate(kube.obj("CompressedModel", "m")["spec"])
    kube.patch("tenant", "CompressedModel", "ns", "m", {"status": {"build": {"fingerprint": fingerprint(changed)}}})
    step(kube)
    assert "m-g2-compress" in kube.names("Job"), "the changed spec was not built"
    assert any(reason == "StatusRestored" and "fingerprint" in message for _, reason, message in kube.events)


def test_a_stage_whose_build_has_no_plan_is_read_again(kube: FakeKube) -> None:
    """A status that points the build at a generation the operator never planned is not taken: its stages are
    read again, and nothing is deployed from it."""
    kube.apply(manifest())
    drive(kube, "Evaluating")
    status = kube.status("m")
    forged = {"build": {**status["build"], "generation": 7},
              "stages": [{**stage, "state": "Succeeded"} for stage in status["stages"]]}
    kube.patch("tenant", "CompressedModel", "ns", "m", {"status": forged})
    step(kube)
    assert not kube.names("Deployment") and not [name for name in kube.names("Job") if "package" in name]
    assert next(s for s in kube.status("m")["stages"] if s["name"] == "Compress")["state"] == "Running"


def test_a_deployment_change_rolls_out_beside_the_serving_revision(kube: FakeKube) -> None:
    kube.apply(manifest())
    drive(kube, "Ready")
    kube.update_spec("m", {"deployment": {"maxReplicas": 2}})
    assert run(kube, 4, revisions=False).phase == "Deploying"  # the new revision exists but is not available
    assert kube.names("Deployment") == ["m-h100-g1", "m-h100-g2"]
    assert kube.obj("Service", "m-h100")["spec"]["selector"]["tailor.dev/revision"] == "g1"  # still serving g1
    kube.make_available("m-h100-g2")
    ready = step(kube)
    assert ready.phase == "Ready" and ready.status.serving_generation == 2
    assert ready.status.build is not None and ready.status.build.generation == 1  # no rebuild
    assert kube.names("Deployment") == ["m-h100-g2"]
    assert kube.obj("Service", "m-h100")["spec"]["selector"]["tailor.dev/revision"] == "g2"
    assert "m-g2-compress" not in kube.names("Job")


def test_a_failed_gate_keeps_the_serving_revision_and_is_not_retried(kube: FakeKube) -> None:
    kube.apply(manifest())
    drive(kube, "Ready")
    kube.update_spec("m", {"compression": {"rounds": 2}, "jobs": {"podAnnotations": published_results(passed=False)}})
    failed = drive(kube, "Failed")
    assert kube.condition("m", "Failed")["reason"] == "QualityGateFailed"
    assert kube.condition("m", "Ready")["status"] == "True" and failed.status.serving_generation == 1
    assert kube.names("Deployment") == ["m-h100-g1"]
    kube.update_spec("m", {"deployment": {"maxReplicas": 3}})  # same build inputs: the gate is not rerun
    assert step(kube).phase == "Failed" and "m-g4-compress" not in kube.names("Job")


def test_a_floor_change_decides_the_gate_again_from_the_measured_scores(kube: FakeKube) -> None:
    """A generation that changes only minQualityRetention reuses the build (retention 0.59 / 0.60 = 0.9833): it
    gets the build's plan with the new floor, and the gate is decided again at that plan's floor. Raised above
    the retention, the generation fails and generation 1 keeps serving; lowered again, it passes and serves. No
    compression, quantization or evaluation Job runs again."""
    kube.apply(manifest())
    drive(kube, "Ready")
    kube.update_spec("m", {"compression": {"minQualityRetention": 0.99}})
    failed = drive(kube, "Failed")
    assert kube.condition("m", "Failed")["reason"] == "QualityGateFailed"
    assert kube.condition("m", "Ready")["status"] == "True" and failed.status.serving_generation == 1
    assert kube.names("Deployment") == ["m-h100-g1"]
    gate = kube.condition("m", "QualityGatePassed")
    assert gate["status"] == "False" and gate["message"].startswith("re-decided from the measured scores (the "
                                                                    "floor was 0.97): retention 0.9833 against a "
                                                                    "floor of 0.99")
    plan = plan_of(kube, "m-g2-plan")
    assert (plan.evaluate.min_retention, plan.layout.build) == (0.99, 1)
    assert plan == plan_of(kube, "m-g1-plan").model_copy(update={"evaluate": plan.evaluate})  # only the floor
    assert failed.status.build is not None and (failed.status.build.generation,
                                                failed.status.build.plan_generation) == (1, 2)
    assert failed.status.quality is not None and failed.status.quality.min_quality_retention == 0.99
    assert failed.status.quality.passed is False
    assert any(e[:2] == ("Normal", "QualityFloorChanged") and "reused" in e[2] for e in kube.events)

    kube.update_spec("m", {"compression": {"minQualityRetention": 0.95}})
    ready = drive(kube, "Ready")
    assert ready.status.serving_generation == 3 and kube.names("Deployment") == ["m-h100-g3"]
    assert ready.status.quality is not None and ready.status.quality.passed is True
    assert ready.status.quality.min_quality_retention == 0.95
    assert plan_of(kube, "m-g3-plan").evaluate.min_retention == 0.95
    redecided = [e[2] for e in kube.events if e[1] == "QualityGateRedecided"]
    assert redecided == ["re-decided from the measured scores (the floor was 0.99): retention 0.9833 against a floor "
                         f"of 0.95 (next_token_accuracy: child 0.5900, parent 0.6000); SIMULATED, not computed: "
                         f"{SIMULATED}"]
    evaluate = next(s for s in ready.status.stages if s.name == "Evaluate")
    assert (evaluate.state, evaluate.reason) == ("Succeeded", "Simulated")
    built = sorted(job for job in kube.names("Job")
                   if kube.obj("Job", job)["metadata"]["labels"][names.STAGE] in BUILD_STAGES)
    assert built == ["m-g1-compress", "m-g1-evaluate", "m-g1-quantize"]
    assert [e[1] for e in kube.events].count("BuildStarted") == 1


# --- the batch a build is planned at -----------------------------------------------------------------------


def batch_events(kube: FakeKube) -> list[tuple[str, str, str]]:
    return [event for event in kube.events if event[1] == "BatchChosen"]


def test_the_build_is_planned_at_the_most_a_pool_asks_of_each_gpu_and_says_so(kube: FakeKube) -> None:
    body = manifest()  # h100: perNode 16 over 8 GPUs per node, 2 per GPU
    body["spec"]["deployment"]["pools"][1]["concurrency"] = {"total": 40}  # a100: 5 per GPU, but no FP8 math
    kube.apply(body)
    assert step(kube).phase == "Compressing"
    assert plan_of(kube, "m-g1-plan").puzzle.target.batch == 2  # the A100s cannot serve the NVFP4 build
    build = kube.status("m")["build"]
    why = ("pool h100 (perNode 16 over 8 GPUs); left out: a100 (A100-40GB (ampere) has no FP8 math: it cannot "
           "serve the nvfp4 checkpoint)")
    assert (build["batch"], build["batchSource"]) == (2, why)
    assert batch_events(kube) == [("Warning", "BatchChosen", f"batch 2 per GPU from {why}")]
    drive(kube, "Ready")
    pools = [{"name": "h100", "nodeSelector": H100, "concurrency": {"perNode": 64}}]
    kube.update_spec("m", {"deployment": {"pools": pools}})  # asks 8 of each GPU now: served from the same build
    ready = drive(kube, "Ready")
    assert ready.status.build is not None and (ready.status.build.generation, ready.status.build.batch) == (1, 2)
    assert len(batch_events(kube)) == 1
    kube.update_spec("m", {"compression": {"batch": 8}})  # setting it is a build input: a new build
    step(kube)
    assert plan_of(kube, "m-g3-plan").puzzle.target.batch == 8
    assert kube.status("m")["build"]["batchSource"] == "spec.compression.batch"


def test_the_text_on_a_claim_is_what_every_build_stage_reads_and_new_text_rebuilds(kube: FakeKube) -> None:
    body = manifest()
    body["spec"]["compression"]["data"] = {"claimName": "corpora", "path": "legal/train", "heldOutPath":
                                           "legal/eval.jsonl", "textField": "body"}
    give_claim(kube, "corpora")
    kube.apply(body)
    drive(kube, "Ready")
    data = plan_of(kube, "m-g1-plan").puzzle.data  # what compress, quantize and evaluate read (--plan)
    assert (data.text, data.heldout, data.text_field) == ("/data/legal/train", "/data/legal/eval.jsonl", "body")
    for job in kube.names("Job"):
        pod = kube.obj("Job", job)["spec"]["template"]["spec"]
        mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "data"]
        claims = [v["persistentVolumeClaim"] for v in pod["volumes"] if v["name"] == "data"]
        if "package" in job or "speed" in job:  # these read the child and the parent, not the text
            assert mounts == claims == [], job
        else:
            assert mounts == [{"name": "data", "mountPath": "/data", "readOnly": True}], job
            assert claims == [{"claimName": "corpora", "readOnly": True}], job
    kube.update_spec("m", {"compression": {"data": {"heldOutPath": "medical/eval.jsonl"}}})  # new text: a new build
    step(kube)
    assert kube.status("m")["build"]["generation"] == 2
    assert plan_of(kube, "m-g2-plan").puzzle.data.heldout == "/data/medical/eval.jsonl"


def test_without_nodes_to_ask_the_build_is_planned_at_batch_1_with_a_warning() -> None:
    kube = FakeKube(nodes=[])  # the GPU pools are scaled to zero while the build is planned
    kube.apply(manifest())
    assert step(kube).phase == "Compressing"
    assert plan_of(kube, "m-g1-plan").puzzle.target.batch == 1
    ((kind, _, message),) = batch_events(kube)
    assert kind == "Warning" and message.startswith("batch 1 per GPU from the default: no pool of spec.deployment "
                                                    "can serve the build on its nodes yet (h100 (no node matches")
    kube.node_list.extend(ready_nodes())  # the pools scale up: the build under way is not planned again
    ready = drive(kube, "Ready")
    assert ready.status.build is not None and (ready.status.build.generation, ready.status.build.batch) == (1, 1)


# --- hardening: names and API refusals ------------------------------------------------------------------


def test_a_write_the_api_server_refuses_fails_naming_the_object_and_the_message(kube: FakeKube) -> None:
    kube.apply(manifest())
    kube.refusals[("create", "Job")] = (422, 'Job.batch "m-g1-compress" is invalid: metadata.name: too long')
    failed = step(kube)
    assert failed.phase == "Failed"
    condition = kube.condition("m", "Failed")
    assert condition["reason"] == "ApiRejected"
    assert "Job m-g1-compress" in condition["message"] and "422" in condition["message"]
    assert "metadata.name: too long" in condition["message"]
    assert kube.refused == [("create", "Job", "m-g1-compress")]
    warnings = [e for e in failed.events if e.reason == "ApiRejected"]
    for _ in range(3):  # settled, not a retry loop: the refused create is not sent again, nor said again
        again = step(kube)
        assert again.phase == "Failed" and not any(e.reason == "ApiRejected" for e in again.events)
    assert kube.refused == [("create", "Job", "m-g1-compress")] and len(warnings) == 1
    assert ("create", "Job", "m-g1-compress") not in kube.writes
    # a spec change is a new generation: the create is sent again; once it goes through, Failed goes
    del kube.refusals[("create", "Job")]
    kube.update_spec("m", {"jobs": {"backoffLimit": 2}})
    assert step(kube).phase == "Compressing" and ("create", "Job", "m-g1-compress") in kube.writes  # build 1 reused
    assert "Failed" not in {c["type"] for c in kube.status("m")["conditions"]}


def test_a_refused_write_is_sent_again_when_it_changes_and_failed_clears_when_it_goes_through(
        kube: FakeKube) -> None:
    """The same generation, another write (the nodes changed the revision's sizing): it is sent; once the
    writes go through, the Failed condition and the Failed Ready go with the cause."""
    kube.apply(manifest())
    drive(kube, "Deploying")
    kube.refusals[("create", "Deployment")] = (403, 'deployments.apps is forbidden: exceeded quota: gpus')
    controllers(kube)  # the package Jobs finish: the revisions are next
    assert step(kube).phase == "Failed" and len(kube.refused) == 1
    assert step(kube).phase == "Failed" and len(kube.refused) == 1  # the same write: not sent again
    del kube.refusals[("create", "Deployment")]
    h100 = next(n for n in kube.node_list if n["metadata"]["labels"].get("nvidia.com/gpu.product") == H100[
        "nvidia.com/gpu.product"])
    kube.node_list.remove(h100)  # one H100 node fewer: the pool's revision is sized again, another write
    deploying = step(kube)
    assert deploying.phase == "Deploying" and kube.refused == [("create", "Deployment", "m-h100-g1")]
    assert "Failed" not in {c["type"] for c in kube.status("m")["conditions"]}
    assert "Ready" not in {c["type"] for c in kube.status("m")["conditions"]}  # nothing serves yet


# --- hardening: results are untrusted input --------------------------------------------------------------


LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}


def _compress(config: str, **fields: Any) -> str:
    """A compress result as a pod could write it, valid or not."""
    values: dict[str, Any] = dict(child="/artifacts/x", params=75_000_000_000, active_params=9_000_000_000,
                                  parent_params=120_000_000_000, parent_active_params=12_000_000_000,
                                  pattern="M" * 8, predicted_speedup=2.0, kl_to_parent=0.1, config=config)
    return json.dumps({"stage": "compress", **values, **fields})


def _packed(raw: bytes) -> str:
    """Bytes packed as a result packs its config (gzip, base64), whatever they are."""
    return base64.b64encode(gzip.compress(raw)).decode()


def test_a_stage_killed_for_memory_says_so_with_its_limit() -> None:
    """The Job's failure names the OOM kill and the limit, before the log tail its container left (the old
    message was the log tail alone: a stage that simply stopped)."""
    pod = {"metadata": {"labels": {"batch.kubernetes.io/job-name": "m-g1-compress"}, "creationTimestamp": "t"},
           "spec": {"containers": [{"name": "compress", "resources": {"limits": {"memory": "4912Mi"}}}]},
           "status": {"containerStatuses": [{"name": "compress", "state": {"terminated": {
               "exitCode": 137, "reason": "OOMKilled", "message": "[13.3s] gkd: the parent sharded"}}}]}}
    assert termination_messages([pod]) == {"m-g1-compress": (
        "OOMKilled: container compress went over its memory limit 4912Mi (set spec.jobs.resources.limits.memory to "
        "give it more); [13.3s] gkd: the parent sharded")}


@pytest.mark.parametrize(("label", "stage", "message", "says"), [
    ("not JSON", "compress", "Segmentation fault (core dumped)", "Invalid JSON"),
    ("an extra field", "compress", _compress(pack_config(LLAMA), extra=1), "extra"),
    ("a negative size", "compress", _compress(pack_config(LLAMA), params=-1), "params"),
    ("a decompression bomb", "compress", _compress(_packed(b'{"a": "' + b"0" * (64 << 20) + b'"}')[:3000]),
     "packed config"),
    ("deeply nested JSON", "compress", _compress(_packed(b"[" * 100_000 + b"]" * 100_000)),
     "nests deeper than 64 levels"),
    ("an unknown model type", "compress", _compress(pack_config({"model_type": "gpt-x", "hidden_size": 8})),
     "gpt-x"),
    ("a recipe of another precision", "quantize", QuantizeResult(
        checkpoint="/x", recipe="fp8", quant_algo="FP8", kv_cache_quant_algo="FP8", weight_bytes=10,
        kl_to_unquantized=0.1).message(), "not a nvfp4 recipe"),
    ("an unknown recipe", "quantize", QuantizeResult(
        checkpoint="/x", recipe="int2", quant_algo="X", kv_cache_quant_algo=None, weight_bytes=10,
        kl_to_unquantized=None).message(), "int2"),
    ("a score above 1", "evaluate", '{"stage": "evaluate", "metric": "next_token_accuracy", "parent_score": 7, '
     '"child_score": 0.5, "retention": 0.1, "min_retention": 0.1, "passed": true, "parent_perplexity": 1, '
     '"child_perplexity": 1, "kl_to_parent": 0, "tokens": 4}', "parent_score"),
])
def test_a_result_that_is_not_what_tailor_writes_fails_the_stage(kube: FakeKube, label: str, stage: str,
                                                                 message: str, says: str) -> None:
    results = published_results()
    results[RESULT_ANNOTATION.format(stage=stage)] = message
    kube.apply(manifest(results=results))
    failed = drive(kube, "Failed")
    condition = kube.condition("m", "Failed")
    assert condition["reason"] == "InvalidResult", label
    assert says in condition["message"], condition["message"]
    assert (len(condition["message"]) < 2048 and failed.status.architecture is None) or stage != "compress"


@pytest.mark.parametrize(("config", "says"), [
    ({**LLAMA, "num_hidden_layers": 10**8}, "'num_hidden_layers' is 100000000; at most 4096 layers"),
    ({"model_type": "nemotron_h", "hybrid_override_pattern": "M" * 10**5}, "has 100000 blocks; at most 4096"),
    ({"model_type": "nemotron_h", "layers_block_type": ["mamba"] * 10**5}, "has 100000 entries; at most 4096"),
])
def test_a_child_with_too_many_blocks_is_refused_before_they_are_built(kube: FakeKube, config: dict[str, Any],
                                                                       says: str) -> None:
    """A layer count is checked before anything is built per layer: a hundred million layers cost nothing."""
    results = published_results()
    results[RESULT_ANNOTATION.format(stage="compress")] = _compress(pack_config(config))
    kube.apply(manifest(results=results))
    tracemalloc.start()
    try:
        drive(kube, "Failed")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert says in kube.condition("m", "Failed")["message"]
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB to refuse it"


def test_a_pass_that_cannot_decide_fails_its_object_after_a_few_tries(kube: FakeKube,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever deciding raises (a bug, data no check caught), the object ends Failed with the error after
    MAX_DECIDE_TRIES passes running, instead of a retry loop behind a log line; then one try per pass, with
    nothing new written while it fails the same way, and the object moves on once deciding works again."""
    kube.apply(manifest())
    step(kube)

    def broken(world: Any, settings: Any) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(execute, "decide", broken)
    for tries in range(MAX_DECIDE_TRIES - 1):
        with pytest.raises(DecideFailed) as raised:
            reconcile(kube, "ns", "m", SETTINGS, tries)
        assert raised.value.tries == tries + 1
    assert kube.status("m")["phase"] == "Compressing"  # not failed on a first try
    failed = reconcile(kube, "ns", "m", SETTINGS, MAX_DECIDE_TRIES - 1)
    assert failed is not None and failed.phase == "Failed" and failed.undecided
    condition = kube.condition("m", "Failed")
    assert condition["reason"] == "Undecidable" and "RecursionError: maximum recursion depth" in condition["message"]
    writes = len(kube.writes)
    again = reconcile(kube, "ns", "m", SETTINGS, MAX_DECIDE_TRIES - 1)
    assert again is not None and again.undecided and len(kube.writes) == writes
    monkeypatch.undo()
    assert step(kube).phase == "Compressing"
    assert "Failed" not in {c["type"] for c in kube.status("m")["conditions"]}


def test_a_job_that_succeeded_without_a_result_fails_with_no_result(kube: FakeKube) -> None:
    kube.apply(manifest())
    step(kube)
    kube.finish_job("m-g1-compress", "")
    step(kube)
    assert kube.condition("m", "Failed")["reason"] == "NoResult"


# --- hardening: planOverrides -----------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "reason", "says"), [
    # what the spec decides: refused at admission (CEL), and by the operator for an object stored before that
    ({"rounds": 1000000}, "InvalidSpec", "planOverrides.rounds is set from spec.compression.rounds"),
    ({"bld": {"tokens": 10**15}}, "InvalidSpec", "planOverrides.bld.tokens is set from"),
    ({"parent": "/etc"}, "InvalidSpec", "planOverrides.parent is set from spec.source"),
    ({"data": {"text": "/var/run/secrets"}}, "InvalidSpec",
     "planOverrides.data.text is set from spec.compression.data.path"),
    ({"data": {"heldout": "/etc"}}, "InvalidSpec",
     "planOverrides.data.heldout is set from spec.compression.data.heldOutPath"),
    # what the plan bounds: the operator, which knows the plan
    ({"solutions": 10**6}, "InvalidPlan", "solutions: Input should be less than or equal to 16"),
    ({"library": {"ffnWidths": [0.5] * 100}}, "InvalidPlan", "library.ffnWidths"),
    ({"library": {"ffnWidth": [0.5]}}, "InvalidPlan", "library.ffnWidth"),
])
def test_plan_overrides_are_bounded_and_cannot_change_what_the_operator_decides(
        kube: FakeKube, overrides: dict[str, Any], reason: str, says: str) -> None:
    body = manifest()
    body["spec"]["compression"]["planOverrides"] = overrides
    kube.apply(body)
    assert step(kube).phase == "Failed"
    condition = kube.condition("m", "Failed")
    assert condition["reason"] == reason and says in condition["message"], condition["message"]
    assert not kube.names("Job")


# --- the pre-flight check ------------------------------------------------------------------------------------


def test_a_compression_that_cannot_fit_fails_naming_the_stage_and_creates_nothing(kube: FakeKube) -> None:
    body = builtin_super({"gpusPerNode": 8, "nodes": 2}, global_tokens=100_000)
    body["spec"]["storage"] = {"size": "1Ti"}  # the chart's default, too small for this build
    give_claim(kube, "models")
    kube.apply(body)
    assert step(kube).phase == "Failed"
    condition = kube.condition("m", "Failed")
    assert condition["reason"] == "DoesNotFit", condition
    assert condition["message"].startswith("the compression does not fit 2 node(s) x 8 H100-80GB: stage gkd needs ")
    assert condition["message"].endswith("GiB short; try spec.jobs.nodes 3")  # a 76B child's fp32 AdamW shards
    assert not kube.names("Job") and kube.names("PersistentVolumeClaim") == ["models"] and not kube.names(
        "ConfigMap")
    (compress,) = kube.status("m")["stages"]
    assert (compress["name"], compress["state"], compress["reason"]) == ("Compress", "Failed", "DoesNotFit")
    kube.update_spec("m", {"jobs": {"nodes": 3}})  # what the message advises: a new generation, a new try
    # the default 1Ti claim cannot hold what this build writes: refused before a claim or Job exists
    assert step(kube).phase == "Failed"
    condition = kube.condition("m", "Failed")
    assert condition["reason"] == "ClaimTooSmall", condition
    assert condition["message"] == (
        "PersistentVolumeClaim m-artifacts would hold 1Ti (1,100 GB), but the build writes up to 8,266 GB (round "
        "children 912 GB, GKD checkpoints 1,824 GB, child 152 GB, quantized child 76 GB, stage files 5,302 GB): set "
        "spec.storage.size to at least 7.6Ti; nothing was started")
    assert not kube.names("Job") and kube.names("PersistentVolumeClaim") == ["models"]
    kube.update_spec("m", {"storage": {"size": "10Ti"}})
    assert step(kube).phase == "Compressing"
    assert kube.obj("PersistentVolumeClaim", "m-artifacts")["spec"]["resources"]["requests"]["storage"] == "10Ti"
    job = kube.obj("Job", "m-g3-compress")["spec"]
    assert job["completions"] == 3 and job["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": "8", "memory": f"{(8 * 40 + 64) * 1024}Mi"}  # 32 GiB per GPU assumed x 1.25, + shm
    assert any(reason == "FitChecked" and "fits 3 node(s) x 8 H100-80GB" in message
               for _, reason, message in kube.events)
    assert any(reason == "ClaimChecked" and "up to 8,266 GB" in message for _, reason, message in kube.events)


def test_a_cpu_compression_requests_the_memory_its_ranks_hold() -> None:
    from tailor.compressor.model.architecture import load_architecture
    from tailor.compressor.puzzle.footprint import footprint
    from tailor.operator.preflight import host_need

    kube = FakeKube()
    body = yaml.safe_load((REPO / "examples" / "smollm2-135m-cpu.yaml").read_text())
    body["metadata"] = {"name": "m", "namespace": "ns"}
    body["spec"]["jobs"] = {"gpusPerNode": 2}
    give_claim(kube, "models")
    kube.apply(body)
    assert step(kube).phase == "Compressing"
    resources = kube.obj("Job", "m-g1-compress")["spec"]["template"]["spec"]["containers"][0]["resources"]
    plan = plan_of(kube, "m-g1-plan")
    fp = footprint(load_architecture("smollm2-135m"), plan.puzzle, plan.catalog().get("cpu"), gpus_per_node=2)
    need = host_need(fp)
    assert need is not None and fp.fits
    assert (resources["requests"]["memory"], resources["limits"]["memory"]) == (need.request(), need.limit(16 * 2**30))
    assert int(resources["requests"]["memory"].removesuffix("Mi")) > 4096  # more than the 2 x 2Gi floor says


def test_a_gpu_compression_that_offloads_gkd_requests_the_host_memory_it_keeps_there(kube: FakeKube) -> None:
    """planOverrides' gkd.offload moves the child's training state to host memory: the refusal above fits two
    nodes of 8 H100, and the pod asks for its share of that state (16 bytes x 76B / 2 nodes) with the allowance."""
    body = builtin_super({"gpusPerNode": 8, "nodes": 2}, global_tokens=100_000)
    body["spec"]["storage"] = {"size": "10Ti"}
    body["spec"]["compression"]["planOverrides"] = {"gkd": {"offload": True}}
    give_claim(kube, "models")
    kube.apply(body)
    assert step(kube).phase == "Compressing"
    resources = kube.obj("Job", "m-g1-compress")["spec"]["template"]["spec"]["containers"][0]["resources"]
    offloaded = round(16 * 76e9 / 16) * 8  # the example caps its child at 76B parameters; 8 of 16 ranks a node
    need = offloaded + 8 * 32 * 2**30
    assert resources["requests"]["memory"] == f"{-(-need // 2**20)}Mi"
    assert any(reason == "FitChecked" and "fits 2 node(s) x 8 H100-80GB" in message
               for _, reason, message in kube.events)


# --- hardening: node churn and rollouts -----------------------------------------------------------------


@pytest.mark.parametrize("churn", ["NotReady", "no GPUs", "scaled to zero", "cordoned"])
def test_node_churn_never_takes_a_serving_revision_down(kube: FakeKube, churn: str) -> None:
    kube.apply(manifest())
    drive(kube, "Ready")
    h100s = [n for n in kube.node_list if n["metadata"]["labels"].get("nvidia.com/gpu.product") == H100[
        "nvidia.com/gpu.product"]]
    for node in h100s:
        if churn == "NotReady":
            node["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        elif churn == "no GPUs":
            node["status"]["allocatable"]["nvidia.com/gpu"] = "0"
        elif churn == "cordoned":
            node.setdefault("spec", {})["unschedulable"] = True
        else:
            kube.node_list.remove(node)
    assert step(kube).phase == "Ready"
    assert kube.names("Deployment") == ["m-h100-g1"] and "m-h100" in kube.names("Service")
    kube.update_spec("m", {"deployment": {"maxReplicas": 2}})  # a new generation while the pool is gone
    waiting = step(kube)
    assert waiting.phase == "Deploying" and "skipped now" in (waiting.status.stages[-1].message or "")
    assert kube.names("Deployment") == ["m-h100-g1"]
    assert kube.obj("Service", "m-h100")["spec"]["selector"]["tailor.dev/revision"] == "g1"
    assert kube.condition("m", "Ready")["status"] == "True"


def test_a_build_keeps_every_generation_a_revision_reads(kube: FakeKube) -> None:
    """A pool whose nodes went away keeps its older revision (g1) while the other pool serves g2: the next
    build's plan keeps both folders (it kept only the serving generation's, and g1's model went from under the
    revision that still serves)."""
    b200 = {"nvidia.com/gpu.product": "NVIDIA-B200"}
    pools = [{"name": "h100", "nodeSelector": H100, "concurrency": {"perNode": 16}},
             {"name": "b200", "nodeSelector": b200, "concurrency": {"perNode": 16}}]
    kube.apply(manifest(pools=pools))
    drive(kube, "Ready")
    kube.node_list = [n for n in kube.node_list if n["metadata"]["labels"].get("nvidia.com/gpu.product") !=
                      b200["nvidia.com/gpu.product"]]
    kube.update_spec("m", {"deployment": {"maxReplicas": 2}})  # deployment only: g2 on h100, b200 keeps g1
    drive(kube, "Ready")
    assert kube.names("Deployment") == ["m-b200-g1", "m-h100-g2"] and kube.status("m")["servingGeneration"] == 2
    kube.update_spec("m", {"compression": {"rounds": 2}})  # a new build, g3
    step(kube)
    assert plan_of(kube, "m-g3-plan").layout.keep == [1, 2]


def test_a_rebuild_keeps_the_last_good_child_until_the_new_one_passes_its_gate(kube: FakeKube) -> None:
    """With no deployment nothing serves: the last build that passed its gate is kept by the next build (it
    was pruned as soon as the next build started, before the new child existed)."""
    body = manifest()
    body["spec"]["deployment"] = None
    kube.apply(body)
    drive(kube, "Ready")
    kube.update_spec("m", {"compression": {"rounds": 2}})  # a new build, g2
    step(kube)
    assert plan_of(kube, "m-g2-plan").layout.keep == [1]
    kube.update_spec("m", {"compression": {"rounds": 1}})  # g3 starts before g2 passed its gate
    step(kube)
    assert plan_of(kube, "m-g3-plan").layout.keep == [1]  # g1 is still the last good child


def test_removing_the_deployment_removes_the_triton_objects(kube: FakeKube) -> None:
    kube.apply(manifest())
    drive(kube, "Ready")
    kube.update_spec("m", {"deployment": None})
    ready = step(kube)
    assert ready.phase == "Ready" and kube.condition("m", "Ready")["reason"] == "Built"
    assert not kube.names("Deployment") and not kube.names("Service")
    assert not kube.names("HorizontalPodAutoscaler") and not kube.names("PodDisruptionBudget")
    assert not kube.names("NetworkPolicy")
    assert ready.status.pools == [] and ready.status.endpoints == []
    writes = len(kube.writes)
    assert step(kube).phase == "Ready" and kube.writes[writes:] == []  # nothing deleted again


def test_serving_pods_get_no_egress_and_other_pods_keep_theirs(kube: FakeKube) -> None:
    """One NetworkPolicy per model denies every egress (DNS too) to every pod but the compression Job's (which
    downloads the parent): the later stages, which read it from the claim's cache offline, the Triton revisions
    and the speed Job. Another lets only the model's namespace and the monitoring stack in (the old operator made
    none: any pod of any namespace could call a model and read its metrics)."""
    kube.apply(manifest(pools=[{"name": "h100", "nodeSelector": H100, "concurrency": {"perNode": 16}},
                               {"name": "h100-b", "nodeSelector": H100, "concurrency": {"perNode": 8}}]))
    for _ in range(20):
        decision = step(kube)
        sent = [a for a in decision.actions if isinstance(a, Create) and a.manifest["kind"] == "NetworkPolicy"]
        assert len(sent) <= 2  # the policies come with each Job and revision, and a pass sends each once
        if decision.phase == "Ready":
            break
        controllers(kube)
    assert len(kube.names("Deployment")) == 2
    assert kube.names("NetworkPolicy") == ["m-ingress", "m-no-egress"]
    ingress = kube.obj("NetworkPolicy", "m-ingress")["spec"]
    assert ingress["policyTypes"] == ["Ingress"] and ingress["ingress"] == [{"from": [
        {"podSelector": {}},  # the model's own namespace
        {"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}]}}]}]
    policy = kube.obj("NetworkPolicy", "m-no-egress")
    assert ingress["podSelector"] == policy["spec"]["podSelector"]
    assert policy["spec"]["policyTypes"] == ["Egress"] and policy["spec"]["egress"] == []
    assert policy["metadata"]["ownerReferences"][0]["kind"] == "CompressedModel"
    selector = policy["spec"]["podSelector"]["matchLabels"]

    def selected(labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in selector.items())

    pods = {name: kube.obj("Job", name)["spec"]["template"]["metadata"]["labels"] for name in kube.names("Job")}
    pods["m-h100-g1"] = kube.obj("Deployment", "m-h100-g1")["spec"]["template"]["metadata"]["labels"]
    assert {name for name, labels in pods.items() if not selected(labels)} == {"m-g1-compress"}


def test_the_clients_an_operator_is_told_of_may_reach_every_model() -> None:
    allowed = ServingIngress(monitoring_namespaces=("prometheus",), client_namespaces=("gateway", "prometheus"),
                             client_cidrs=("10.20.0.0/16",))
    policy = ingress_policy({"metadata": {"name": "m", "namespace": "ns", "uid": "u"}}, allowed)
    assert policy["metadata"]["name"] == "m-ingress" and policy["spec"]["ingress"] == [{"from": [
        {"podSelector": {}},
        {"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["gateway", "prometheus"]}]}},
        {"ipBlock": {"cidr": "10.20.0.0/16"}}]}]


def test_a_renamed_pool_serves_before_the_old_one_goes(kube: FakeKube) -> None:
    kube.apply(manifest())
    drive(kube, "Ready")
    pools = [{"name": "hopper", "nodeSelector": H100, "concurrency": {"perNode": 16}}]
    kube.update_spec("m", {"deployment": {"pools": pools}})
    assert run(kube, 4, revisions=False).phase == "Deploying"
    assert kube.names("Deployment") == ["m-h100-g1", "m-hopper-g2"]  # the old pool serves meanwhile
    assert kube.names("Service") == ["m-h100", "m-hopper"]
    kube.make_available("m-hopper-g2")
    assert step(kube).phase == "Ready"
    assert kube.names("Deployment") == ["m-hopper-g2"] and kube.names("Service") == ["m-hopper"]


def test_a_revision_that_cannot_become_available_fails_and_frees_its_gpus(kube: FakeKube) -> None:
    kube.apply(manifest())
    drive(kube, "Ready")
    kube.update_spec("m", {"deployment": {"tritonImage": "ghcr.io/tailor-dev/tailor-runtime:broken"}})
    assert run(kube, 4, revisions=False).phase == "Deploying"
    deadline = kube.obj("Deployment", "m-h100-g2")["spec"]["progressDeadlineSeconds"]
    assert deadline > 300  # the startup allowance for the weights, then five minutes
    assert math.ceil(kube.status("m")["pools"][0]["startupSeconds"] / 10) * 10 == deadline - 300  # in probe periods
    kube.stall("m-h100-g2")
    crash = "E1204 model.py:88] CUDA out of memory. Tried to allocate 2.00 GiB\nerror: creating server: Internal"
    labels = kube.obj("Deployment", "m-h100-g2")["spec"]["selector"]["matchLabels"]
    kube.create("kubelet", {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "m-h100-g2-abc-1", "namespace": "ns", "labels": labels}, "status": {
        "phase": "Running", "conditions": [{"type": "Ready", "status": "False", "message": "containers with "
                                            "unready status: [triton]"}],
        "containerStatuses": [{"name": "triton", "restartCount": 4, "state": {"waiting": {
            "reason": "CrashLoopBackOff", "message": "back-off 2m40s restarting failed container"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": crash}}}]}})
    assert step(kube).phase == "Failed"
    failed = kube.condition("m", "Failed")
    assert failed["reason"] == "RevisionFailed"
    # what its pods said is kept before they go: state, restarts, the last log lines of the crash
    for said in ("pod m-h100-g2-abc-1: Running", "triton waiting (CrashLoopBackOff)", "restarted 4 time(s)",
                 "last exited 1 (Error)", "CUDA out of memory"):
        assert said in failed["message"], said
        assert any(reason == "RevisionFailed" and said in message for _, reason, message in kube.events), said
    assert kube.names("Deployment") == ["m-h100-g1"]  # the stalled revision is gone, the old one serves
    assert kube.condition("m", "Ready")["status"] == "True"
    # it stays failed: no new revision (no loop of create, deadline, delete), nothing new said, and the status
    # says what retries the pool
    (pool,) = [s for s in kube.status("m")["pools"] if s["name"] == "h100"]
    assert (pool["failed"]["deployment"], pool["failed"]["retry"]) == ("m-h100-g2", "SpecChange")
    assert "tried again when the spec changes" in failed["message"]
    said = len(kube.events)
    for _ in range(3):
        assert step(kube).phase == "Failed"
    assert kube.names("Deployment") == ["m-h100-g1"] and len(kube.events) == said
    kube.update_spec("m", {"deployment": {"tritonImage": SERVING_IMAGE}})  # fixed: a new revision
    assert run(kube, 3, revisions=False).phase == "Deploying" and "m-h100-g3" in kube.names("Deployment")
    assert not any("failed" in s for s in kube.status("m")["pools"]) and "Failed" not in {
        c["type"] for c in kube.status("m")["conditions"]}


def test_a_revision_with_no_room_to_schedule_is_tried_again_once_the_pool_has_free_gpus(kube: FakeKube) -> None:
    """Its pods could not be scheduled: the revision fails and is deleted, and the pool is tried again only once
    its free GPUs hold the replicas the revision asked for (not at once, not in a loop)."""
    kube.apply(manifest())
    drive(kube, "Ready")
    kube.update_spec("m", {"deployment": {"tritonImage": "ghcr.io/tailor-dev/tailor-runtime:2"}})
    assert run(kube, 4, revisions=False).phase == "Deploying"
    asked = kube.obj("Deployment", "m-h100-g2")["spec"]["replicas"]
    kube.stall("m-h100-g2")
    labels = kube.obj("Deployment", "m-h100-g2")["spec"]["selector"]["matchLabels"]
    kube.create("scheduler", {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "m-h100-g2-abc-1", "namespace": "ns", "labels": labels}, "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/4 nodes are available: 2 Insufficient nvidia.com/gpu"}]}})
    h100s = [n["metadata"]["name"] for n in kube.node_list
             if n["metadata"]["labels"].get("nvidia.com/gpu.product") == H100["nvidia.com/gpu.product"]]
    for node in h100s:  # a training Job takes every H100
        kube.create("scheduler", {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": f"train-{node}", "namespace": "other"}, "spec": {"nodeName": node, "containers": [
                {"name": "train", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}, "status": {"phase": "Running"}})
    failed = step(kube)
    assert failed.phase == "Failed" and failed.requeue_s == WAITING_REQUEUE_S  # free GPUs wake nothing
    (pool,) = [s for s in kube.status("m")["pools"] if s["name"] == "h100"]
    assert (pool["failed"]["retry"], pool["failed"]["replicas"]) == ("Capacity", asked)
    assert f"once its free GPUs hold the {asked} replica(s)" in kube.condition("m", "Failed")["message"]
    for _ in range(3):  # no room yet: no new revision
        assert step(kube).phase == "Failed" and "m-h100-g2" not in kube.names("Deployment")
    for node in h100s:  # the training is done
        kube.remove("test", "Pod", "other", f"train-{node}")
    assert step(kube).phase == "Deploying" and "m-h100-g2" in kube.names("Deployment")
    assert any(reason == "RevisionRetried" for _, reason, _ in kube.events)


# --- hardening: ownership ---------------------------------------------------------------------------------


def test_objects_of_another_owner_are_never_adopted(kube: FakeKube) -> None:
    kube.create("test", {"apiVersion": "batch/v1", "kind": "Job", "metadata": {
        "name": "m-g1-compress", "namespace": "ns", "labels": {"tailor.dev/model": "m"},
        "ownerReferences": [{"uid": "someone-else"}]}, "spec": {}})
    kube.apply(manifest())
    assert step(kube).phase == "Failed"
    condition = kube.condition("m", "Failed")
    assert condition["reason"] == "OwnedElsewhere" and "Job m-g1-compress" in condition["message"]
    (compress,) = [s for s in kube.status("m")["stages"] if s["name"] == "Compress"]
    assert (compress["state"], compress["reason"]) == ("Pending", "OwnedElsewhere")
    kube.remove("test", "Job", "ns", "m-g1-compress")  # its owner removes it: the build goes on, with its own Job
    assert step(kube).phase == "Compressing"
    job, model = kube.get("test", "Job", "ns", "m-g1-compress"), kube.get("test", "CompressedModel", "ns", "m")
    assert job is not None and model is not None and owned_by(job, model["metadata"]["uid"])


ADMINS_POLICY = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",  # found only by a create's 409
                 "metadata": {"name": "m-ingress", "namespace": "ns"}, "spec": {"podSelector": {}}}


def test_a_name_another_object_holds_fails_the_model_and_that_object_is_left_alone(kube: FakeKube) -> None:
    """The namespace admin's NetworkPolicy where the model's ingress policy goes: the model fails naming it, and
    neither that nor removing the deployment takes, changes or deletes it."""
    kube.create("admin", ADMINS_POLICY)
    kube.apply(manifest())
    drive(kube, "Failed")
    condition = kube.condition("m", "Failed")
    assert condition["reason"] == "OwnedElsewhere" and "NetworkPolicy m-ingress exists" in condition["message"]
    theirs = copy.deepcopy(kube.obj("NetworkPolicy", "m-ingress"))
    kube.update_spec("m", {"deployment": None})
    drive(kube, "Ready")
    assert kube.obj("NetworkPolicy", "m-ingress") == theirs and "m-no-egress" not in kube.names("NetworkPolicy")


def test_a_revision_whose_hpa_name_is_taken_is_not_made_and_stays_failed(kube: FakeKube) -> None:
    """The revision's companions are created before it: with the HPA's name another's, no Deployment is made, so
    every later pass asks again and fails again, instead of serving beside an HPA that is not its own."""
    kube.create("admin", {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                          "metadata": {"name": "m-h100-g1", "namespace": "ns"}, "spec": {}})
    kube.apply(manifest())
    drive(kube, "Failed")
    for _ in range(3):
        controllers(kube)
        assert step(kube).phase == "Failed"
    assert "HorizontalPodAutoscaler m-h100-g1 exists" in kube.condition("m", "Failed")["message"]
    assert "m-h100-g1" not in kube.names("Deployment")


def test_a_model_refused_a_name_goes_on_once_that_object_is_removed(kube: FakeKube) -> None:
    kube.create("admin", ADMINS_POLICY)
    kube.apply(manifest())
    drive(kube, "Failed")
    kube.remove("admin", "NetworkPolicy", "ns", "m-ingress")
    drive(kube, "Ready")
    assert owned_by(kube.obj("NetworkPolicy", "m-ingress"), kube.model("m")["metadata"]["uid"])
    assert "Failed" not in {c["type"] for c in kube.status("m")["conditions"]}


def test_a_claim_left_by_an_earlier_object_of_the_same_name_is_not_adopted(kube: FakeKube) -> None:
    kube.apply(manifest())
    drive(kube, "Ready")
    kube.remove("test", "CompressedModel", "ns", "m")  # deletionPolicy Retain: the claim stays
    kube.apply(manifest())
    assert step(kube).phase == "Failed"
    assert kube.condition("m", "Failed")["reason"] == "OwnedElsewhere"
    assert "PersistentVolumeClaim m-artifacts" in kube.condition("m", "Failed")["message"]
    kube.remove("test", "PersistentVolumeClaim", "ns", "m-artifacts")  # the old build's claim goes: a new one
    assert step(kube).phase != "Failed" and "m-artifacts" in kube.names("PersistentVolumeClaim")


def test_deleting_an_object_keeps_a_claim_it_did_not_create(kube: FakeKube) -> None:
    kube.create("test", {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {
        "name": "m-artifacts", "namespace": "ns", "labels": {"tailor.dev/model": "m",
                                                            "tailor.dev/model-uid": "an-earlier-m"}}})
    body = manifest()
    body["spec"]["storage"] = {"deletionPolicy": "Delete"}
    created = kube.apply(body)
    handlers.RUNTIME.kube = kube
    handlers.on_delete(body=created, name="m", namespace="ns", uid=created["metadata"]["uid"],
                       logger=__import__("logging").getLogger("test"))
    assert kube.names("PersistentVolumeClaim") == ["m-artifacts"]


# --- hardening: tenants -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "reason", "says"), [
    ({"jobs": {"image": "docker.io/attacker/miner:latest"}}, "ImageNotAllowed", "spec.jobs.image"),
    ({"deployment": {"tritonImage": "quay.io/x/triton:1"}}, "ImageNotAllowed", "spec.deployment.tritonImage"),
    ({"jobs": {"podAnnotations": {"sidecar.istio.io/inject": "true"}}}, "AnnotationNotAllowed",
     "sidecar.istio.io/inject"),
    ({"storage": {"existingClaim": "someone-elses-data"}}, "ClaimNotAllowed", "tailor.dev/allowed=true"),
    ({"jobs": {"priorityClassName": "system-node-critical"}}, "PriorityClassNotAllowed",
     "spec.jobs.priorityClassName 'system-node-critical' is not allowed"),
    ({"deployment": {"pools": [{"name": "h100", "nodeSelector": H100, "concurrency": {"perNode": 16},
                                "podAnnotations": {"sidecar.istio.io/inject": "true"}}]}}, "AnnotationNotAllowed",
     "spec.deployment.pools[h100].podAnnotations 'sidecar.istio.io/inject' is not allowed"),
    ({"jobs": {"priorityClassName": "gpu-batch"}}, "PriorityClassNotAllowed",
     "spec.jobs.priorityClassName 'gpu-batch' is not allowed (the chart's tenancy.allowedPriorityClasses: none)"),
    ({"jobs": {"podLabels": {"app": "web", "sidecar.istio.io/inject": "true"}}}, "PodLabelNotAllowed",
     "spec.jobs.podLabels 'app', 'sidecar.istio.io/inject' are not allowed"),
    ({"jobs": {"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]}},
     "TolerationNotAllowed", "spec.jobs.tolerations 'node-role.kubernetes.io/control-plane' is not allowed"),
    ({"deployment": {"pools": [{"name": "h100", "nodeSelector": H100, "concurrency": {"perNode": 16},
                                "resources": {"limits": {"devices.kubevirt.io/kvm": "1"}}}]}}, "ResourceNotAllowed",
     "spec.deployment.pools[h100].resources 'devices.kubevirt.io/kvm' is not allowed"),
    ({"jobs": {"resources": {"limits": {"memory": "1Gi"}}}}, "InvalidSpec",
     "spec.jobs.resources: the memory limit 1Gi is below its request 2Gi"),
    ({"jobs": {"resources": {"requests": {"memory": "1"}, "limits": {"memory": "1Pi"}}}}, "InvalidSpec",
     "spec.jobs.resources: the memory request 1 is below a 4th of Tailor's 2Gi"),
])
def test_a_tenant_cannot_reach_past_the_allowlists(kube: FakeKube, change: dict[str, Any], reason: str,
                                                   says: str) -> None:
    kube.create("test", {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "metadata": {"name": "someone-elses-data", "namespace": "ns"}})
    body = manifest()
    for key, value in change.items():
        body["spec"][key] = value if key == "storage" else {**body["spec"].get(key, {}), **value}
    kube.apply(body)
    assert step(kube).phase == "Failed"
    condition = kube.condition("m", "Failed")
    assert condition["reason"] == reason and says in condition["message"], condition["message"]
    assert not kube.names("Job")


def claim(name: str, labels: dict[str, str] | None = None, shared: str | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {
        "name": name, "namespace": "ns", "labels": labels or {},
        "annotations": {} if shared is None else {"tailor.dev/shared-with": shared}}}


ALLOWED = {"tailor.dev/allowed": "true"}


@pytest.mark.parametrize(("claims", "spec", "says"), [
    # another model's artifacts claim, named as a source (seen on a live cluster with pvc://<claim>/../../)
    ([claim("other-artifacts", {"tailor.dev/model": "other", "tailor.dev/model-uid": "0ther"})],
     {"source": {"uri": "pvc://other-artifacts/child"}},
     "spec.source.uri: PersistentVolumeClaim other-artifacts is not labelled tailor.dev/allowed=true"),
    # ... even labelled for Tailor: it holds another object's artifacts and is not shared with this one
    ([claim("other-artifacts", {**ALLOWED, "tailor.dev/model-uid": "0ther"})],
     {"compression": {"data": {"claimName": "other-artifacts", "path": "x"}}},
     "spec.compression.data.claimName: PersistentVolumeClaim other-artifacts holds another CompressedModel's"),
    ([claim("corpora", ALLOWED)], {"compression": {"data": {"claimName": "corpora", "path": "x"}}},
     "PersistentVolumeClaim corpora is not shared with CompressedModel m: annotate it tailor.dev/shared-with=m"),
    ([claim("corpora", ALLOWED, shared="team-a, team-b")], {"compression": {"data": {"claimName": "corpora",
                                                                                   "path": "x"}}},
     "PersistentVolumeClaim corpora is not shared with CompressedModel m"),
    ([], {"compression": {"data": {"claimName": "corpora", "path": "x"}}},
     "spec.compression.data.claimName: PersistentVolumeClaim corpora does not exist"),
    ([claim("scratch", ALLOWED)], {"storage": {"existingClaim": "scratch"}},
     "spec.storage.existingClaim: PersistentVolumeClaim scratch is not shared with CompressedModel m"),
    ([], {"source": {"uri": "hf://org/model", "credentialsSecret": {"name": "team-b-hf-token"}}},
     "spec.source.credentialsSecret 'team-b-hf-token' is not this object's nor shared by the chart"),
])
def test_a_tenant_gets_only_the_claims_and_secrets_it_was_given(kube: FakeKube, claims: list[dict[str, Any]],
                                                                spec: dict[str, Any], says: str) -> None:
    """A claim or Secret the spec names: refused, naming the field, before any Job mounts it."""
    for found in claims:
        kube.create("test", found)
    body = manifest()
    for key, value in spec.items():
        body["spec"][key] = value if key in ("storage", "source") else {**body["spec"][key], **value}
    kube.apply(body)
    assert step(kube).phase == "Failed"
    condition = kube.condition("m", "Failed")
    assert condition["reason"] in ("ClaimNotAllowed", "SecretNotAllowed") and says in condition["message"], (
        condition["message"])
    assert not kube.names("Job")


@pytest.mark.parametrize("shared", ["m", "team-a, m", "*"])
def test_a_claim_shared_with_the_object_and_a_secret_of_its_own_or_the_charts_are_mounted(
        kube: FakeKube, shared: str) -> None:
    kube.create("test", claim("corpora", ALLOWED, shared=shared))
    body = manifest()
    body["spec"]["compression"]["data"] = {"claimName": "corpora", "path": "x"}
    kube.apply(body)
    assert step(kube).phase == "Compressing"
    team = FakeKube()
    team.apply(manifest(name="n"))
    team.update_spec("n", {"source": {"uri": PRIVATE_PARENT, "credentialsSecret": {"name": "hf-token"}}})
    shares = dataclasses.replace(SETTINGS, tenancy=SETTINGS.tenancy.model_copy(update={"shared_secrets": ["hf-token"]}))
    assert (decided := reconcile(team, "ns", "n", shares)) is not None and decided.phase == "Compressing"


def test_an_existing_claim_labelled_for_tailor_is_used_and_kept(kube: FakeKube) -> None:
    give_claim(kube, "shared")
    body = manifest()
    body["spec"]["storage"] = {"existingClaim": "shared"}
    kube.apply(body)
    step(kube)
    volumes = kube.obj("Job", "m-g1-compress")["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["persistentVolumeClaim"]["claimName"] == "shared"
    assert kube.names("PersistentVolumeClaim") == ["shared"]


# --- upgrades and rollbacks -------------------------------------------------------------------------------


def test_status_from_a_newer_operator_is_read_and_its_fields_left_alone(kube: FakeKube) -> None:
    kube.apply(manifest())
    drive(kube, "Ready")
    status = kube.model("m")["status"]
    status["shardPlan"] = {"ranks": 8}  # a field this operator does not know
    status["phase"] = "Resharding"  # a value it does not know
    status["build"]["engine"] = "vllm"
    assert step(kube).phase == "Ready"
    assert kube.model("m")["status"]["shardPlan"] == {"ranks": 8}
    assert kube.model("m")["status"]["phase"] == "Ready"


# --- one build plan ---------------------------------------------------------------------------------------


def test_a_chart_added_gpu_profile_reaches_the_package_job(kube: FakeKube, tmp_path: Path) -> None:
    from tailor.compressor.sizing.hardware import GpuCatalog

    profiles = tmp_path / "gpus.yaml"
    profiles.write_text(yaml.safe_dump({"profiles": [{
        "name": "H20-96GB", "family": "hopper", "memoryMiB": 97871, "bandwidthGBps": 4000,
        "tflops": {"bf16": 148, "fp8": 296}, "gfdProducts": ["NVIDIA-H20"]}]}))
    node = copy.deepcopy(next(n for n in kube.node_list if n["metadata"]["labels"].get("nvidia.com/gpu.product")
                              == H100["nvidia.com/gpu.product"]))
    node["metadata"]["name"] = "h20-0"
    node["metadata"]["labels"].update({"nvidia.com/gpu.product": "NVIDIA-H20", "nvidia.com/gpu.memory": "97871"})
    kube.node_list.append(node)
    settings = OperatorSettings(catalog=GpuCatalog.load(profiles), tenancy=SETTINGS.tenancy)
    body = manifest()
    body["spec"]["deployment"]["pools"] = [{"name": "h20", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H20"},
                                            "concurrency": {"total": 8}}]
    kube.apply(body)
    for _ in range(8):
        reconcile(kube, "ns", "m", settings)
        for job in kube.names("Job"):
            if job_finished(kube.obj("Job", job)) is None:
                kube.finish_stage(job, body["spec"]["jobs"]["podAnnotations"])
    plan = plan_of(kube, "m-g1-package-h20")
    assert plan.pool is not None and plan.pool.gpu_profile == "H20-96GB"
    assert plan.catalog().get("H20-96GB").gfd_products == ("NVIDIA-H20",)


def test_bf16_builds_skip_quantization_and_size_with_bf16(kube: FakeKube) -> None:
    body = manifest()
    body["spec"]["quantization"] = {"precision": "none", "kvCacheDtype": "bf16"}
    body["spec"]["deployment"]["contextLength"] = body["spec"]["compression"]["contextLength"] = 32768
    kube.apply(body)
    ready = drive(kube, "Ready")
    assert "m-g1-quantize" not in kube.names("Job")
    assert ready.status.build is not None and ready.status.build.recipe == "bf16"
    assert plan_of(kube, "m-g1-plan").quantize is None


# --- results outlive their pods ---------------------------------------------------------------------------


def test_a_result_whose_pod_is_gone_is_read_back_from_the_claim(kube: FakeKube) -> None:
    kube.apply(manifest())
    step(kube)
    kube.finish_job("m-g1-compress", pod=False)  # the GPU node went away with the pod
    assert step(kube).phase == "Compressing"
    reader = kube.obj("Job", "m-g1-compress-r")["spec"]["template"]["spec"]
    assert reader["containers"][0]["command"] == ["tailor", "result", "--plan", "/plan/plan.yaml", "--stage",
                                                  "compress", "--result-file", "/dev/termination-log"]
    assert "nvidia.com/gpu" not in reader["containers"][0]["resources"]["requests"] and "nodeSelector" not in reader
    # no GPU, yet on the stage's nodes (the target GPU's), never wherever the spec's placement alone lets it
    required = reader["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["nodeSelectorTerms"] == gpu_terms(GpuCatalog.load().get("H100"))
    kube.finish_stage("m-g1-compress-r", published_results())
    assert step(kube).phase == "Quantizing"  # no rebuild
    assert kube.names("Job") == ["m-g1-compress", "m-g1-compress-r", "m-g1-quantize"]


def test_a_result_neither_pod_nor_claim_has_fails_with_no_result(kube: FakeKube) -> None:
    kube.apply(manifest())
    step(kube)
    kube.finish_job("m-g1-compress", pod=False)
    step(kube)
    kube.finish_job("m-g1-compress-r", "tailor: error: /artifacts/m-uid/g1/results/compress.json: no compress "
                                       "result on the claim", failed="BackoffLimitExceeded")
    assert step(kube).phase == "Failed"
    condition = kube.condition("m", "Failed")
    assert condition["reason"] == "NoResult" and "no compress result on the claim" in condition["message"]


def test_an_object_waiting_for_its_claim_is_pending_and_starts_no_job(kube: FakeKube) -> None:
    body = manifest()
    body["spec"]["storage"] = {"existingClaim": "shared"}
    kube.apply(body)
    pending = step(kube)
    assert pending.phase == "Pending" and not kube.names("Job")
    assert "PersistentVolumeClaim shared" in (pending.status.stages[0].message or "")
    give_claim(kube, "shared")
    assert step(kube).phase == "Compressing" and kube.names("Job") == ["m-g1-compress"]


def test_a_status_the_api_server_refuses_is_reported_in_one_it_takes(kube: FakeKube) -> None:
    kube.apply(manifest())
    kube.refusals[("status", "CompressedModel")] = (422, "status.stages[0].message: Too long")
    assert step(kube).phase == "Failed"
    condition = kube.condition("m", "Failed")
    assert condition["reason"] == "ApiRejected" and "status.stages[0].message: Too long" in condition["message"]
    writes = len(kube.writes)
    assert step(kube).phase == step(kube).phase == "Failed"  # the same status is not sent again, nor the report
    assert len(kube.refused) == 1 and len(kube.writes) == writes


def test_a_serving_revision_stays_ready_while_its_hpa_adds_replicas(kube: FakeKube) -> None:
    kube.apply(manifest())
    drive(kube, "Ready")
    deployment = kube.obj("Deployment", "m-h100-g1")
    started = deployment["status"]["availableReplicas"]
    deployment["spec"]["replicas"] = started + 1  # the HPA scales out; the new replica is still starting
    deployment["metadata"]["generation"] += 1
    assert step(kube).phase == "Ready"
    deployment["status"]["availableReplicas"] = 0  # below the HPA's floor (minReplicas 1): not serving
    assert step(kube).phase == "Deploying"


def test_each_stage_job_runs_as_many_processes_as_its_code_handles(kube: FakeKube) -> None:
    """With 8 GPUs on each of 2 nodes, only compression (whose ranks split its work) runs torchrun across them;
    quantization and evaluation run one process on one GPU (8 copies would each quantize the whole model on one GPU
    and write the same folder); packaging and the speed client run one process on no GPU."""
    body = manifest()
    body["spec"]["jobs"].update(gpusPerNode=8, nodes=2)
    kube.apply(body)
    drive(kube, "Ready")
    launched = {}
    for name in kube.names("Job"):
        job = kube.obj("Job", name)
        stage = job["metadata"]["labels"]["tailor.dev/stage"]
        container = job["spec"]["template"]["spec"]["containers"][0]
        launched[stage] = (container["command"][0], job["spec"].get("completions", 1),
                           container["resources"]["requests"].get("nvidia.com/gpu", "0"))
    assert set(launched) == {*DISTRIBUTED_STAGES, *ONE_GPU_STAGES, "package", "speed"}
    for stage, (program, pods, gpus) in launched.items():
        if stage in DISTRIBUTED_STAGES:
            assert (program, pods, gpus) == ("sh", 2, "8"), stage  # torchrun on each node, by its completion index
        else:
            assert (program, pods, gpus) == ("tailor", 1, "1" if stage in ONE_GPU_STAGES else "0"), stage


# --- placement ---------------------------------------------------------------------------------------------


def test_placement_reaches_every_pod_and_kueue_queues_every_job(kube: FakeKube) -> None:
    """spec.jobs places the build Jobs (ANDed with the GPU's labels) and labels every stage Job; a pool places its
    Triton pods and the package and speed Jobs on its nodes; requests and limits go over Tailor's, GPUs stay
    Tailor's; with a queue every Job is created suspended for Kueue."""
    team = {"key": "example.com/team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["zone-a"]}
    body = manifest()
    body["spec"]["jobs"].update(tolerations=[team], priorityClassName="gpu-batch", podLabels={"team": "ml"},
                                nodeAffinity={"requiredDuringSchedulingIgnoredDuringExecution": {
                                    "nodeSelectorTerms": [{"matchExpressions": [zone]}]}},
                                resources={"requests": {"cpu": "16", "memory": "200Gi", "vpc.amazonaws.com/efa": "32"},
                                           "limits": {"memory": "400Gi", "vpc.amazonaws.com/efa": "32"}},
                                queueName="gpus")
    serving = {"key": "example.com/serving", "operator": "Exists"}
    body["spec"]["deployment"]["pools"][0].update(
        tolerations=[serving], priorityClassName="serving-high", podLabels={"tier": "serving"},
        nodeAffinity={"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 50, "preference": {"matchExpressions": [zone]}}]},
        resources={"requests": {"memory": "64Gi"}})
    kube.apply(body)
    allowed = SETTINGS.tenancy.model_copy(update={  # the cluster admin's allowlists for this team
        "allowed_pod_label_prefixes": ["team", "tier"], "allowed_priority_classes": ["gpu-batch", "serving-high"],
        "allowed_toleration_keys": ["example.com/team", "example.com/serving"]})
    drive(kube, "Ready", settings=dataclasses.replace(SETTINGS, tenancy=allowed))
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    h100_terms = gpu_terms(GpuCatalog.load().get("H100"))
    stages = set()
    for name in kube.names("Job"):
        job = kube.obj("Job", name)
        stage, pod = job["metadata"]["labels"]["tailor.dev/stage"], job["spec"]["template"]
        stages.add(stage)
        assert job["spec"]["suspend"] is True and job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpus"
        assert pod["metadata"]["labels"]["team"] == "ml" and pod["metadata"]["labels"]["tailor.dev/stage"] == stage
        resources = pod["spec"]["containers"][0]["resources"]
        if stage in ("compress", "quantize", "evaluate"):
            assert pod["spec"]["tolerations"] == [gpu, team] and pod["spec"]["priorityClassName"] == "gpu-batch"
            terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                "nodeSelectorTerms"]  # any label naming an H100, each in zone-a
            assert terms == [{"matchExpressions": t["matchExpressions"] + [zone]} for t in h100_terms]
            assert resources == {"requests": {"cpu": "16", "memory": "200Gi", "vpc.amazonaws.com/efa": "32",
                                              "nvidia.com/gpu": "1"},
                                 "limits": {"memory": "400Gi", "vpc.amazonaws.com/efa": "32", "nvidia.com/gpu": "1"}}
        else:  # on the h100 pool's nodes, as its Triton pods
            assert pod["spec"]["nodeSelector"] == H100 and pod["spec"]["tolerations"] == [gpu, serving]
            assert pod["spec"]["priorityClassName"] == "serving-high" and "cpu" not in resources.get("limits", {})
            assert resources["requests"]["cpu"] == "500m"
            if stage == "package":  # no GPU: kept to the nodes with the pool's GPU too, not all the selector matches
                assert pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                    "nodeSelectorTerms"] == h100_terms
    assert stages == {"compress", "quantize", "evaluate", "package", "speed"}
    speed = kube.obj("Job", next(n for n in kube.names("Job") if n.endswith("-speed-h100")))
    assert speed["spec"]["template"]["spec"]["initContainers"][0]["resources"]["requests"]["memory"] == "64Gi"
    (deployment,) = [kube.obj("Deployment", n) for n in kube.names("Deployment") if "-h100-" in n]
    h100 = deployment["spec"]["template"]
    assert h100["metadata"]["labels"]["tier"] == "serving" and h100["spec"]["priorityClassName"] == "serving-high"
    assert h100["spec"]["tolerations"] == [gpu, serving] and h100["spec"]["nodeSelector"] == H100
    assert set(h100["spec"]["affinity"]) == {"nodeAffinity", "podAntiAffinity"}
    triton = h100["spec"]["containers"][0]["resources"]
    assert triton["requests"]["memory"] == "64Gi" and triton["requests"]["nvidia.com/gpu"] == triton["limits"][
        "nvidia.com/gpu"]


def test_a_stage_that_cannot_start_says_why_kueue_or_the_scheduler(kube: FakeKube) -> None:
    """A suspended Job waits in its Kueue queue (the Workload's word on quota), a pod the scheduler cannot place says
    which resource on which nodes: the stage is Pending with that reason, the object Pending."""
    body = manifest()
    body["spec"]["jobs"]["queueName"] = "gpu-builds"
    kube.apply(body)
    step(kube)
    (job,) = kube.names("Job")
    uid = kube.obj("Job", job)["metadata"]["uid"]
    assert step(kube).phase == "Pending"
    assert kube.status("m")["stages"][0]["message"] == ("waiting in Kueue LocalQueue gpu-builds: Kueue has made no "
                                                       "Workload for it yet (is Kueue running, and the queue there?)")
    quota = ("couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor "
             "default-flavor, 1 more needed")
    kube.create("kueue", {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload", "metadata": {
        "name": f"job-{job}-1", "namespace": "ns", "labels": {"kueue.x-k8s.io/job-uid": uid}},
        "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                   "message": quota}]}})
    assert step(kube).phase == "Pending"
    compress = kube.status("m")["stages"][0]
    assert (compress["state"], compress["reason"], compress["message"]) == (
        "Pending", "Queued", f"waiting in Kueue LocalQueue gpu-builds: {quota}")
    # admitted: Kueue unsuspends it, and the scheduler finds no node
    kube.patch("kueue", "Job", "ns", job, {"spec": {"suspend": False}})
    unschedulable = ("0/13 nodes are available: 5 Insufficient nvidia.com/gpu, 8 node(s) didn't match Pod's node "
                     "affinity")
    kube.create("scheduler", {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"{job}-x", "namespace": "ns",
        "labels": {"tailor.dev/model": "m", "batch.kubernetes.io/job-name": job}},
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                       "reason": "Unschedulable", "message": unschedulable}]}})
    assert step(kube).phase == "Pending"
    compress = kube.status("m")["stages"][0]
    assert (compress["reason"], compress["message"]) == ("Unschedulable",
                                                         f"pod {job}-x cannot be scheduled: {unschedulable}")
    kube.remove("scheduler", "Pod", "ns", f"{job}-x")
    assert step(kube).phase == "Compressing" and kube.status("m")["stages"][0]["state"] == "Running"


def test_a_running_stage_reports_the_step_its_log_is_at(kube: FakeKube) -> None:
    """The operator reads the end of the running compress pod's log: the stage's progress and message, and the
    object's progress for `kubectl get`; a log it cannot read leaves the pod count."""
    kube.apply(manifest())
    step(kube)
    (job,) = kube.names("Job")
    pod = f"{job}-abcde"
    kube.create("job-controller", {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": pod, "namespace": "ns", "labels": {"tailor.dev/model": "m", "tailor.dev/stage": "compress",
                                                    "batch.kubernetes.io/job-name": job},
        "annotations": {"batch.kubernetes.io/job-completion-index": "0"}}, "status": {"phase": "Running"}})
    kube.patch("job-controller", "Job", "ns", job, {"status": {"active": 1, "ready": 1}})
    assert step(kube).phase == "Compressing"
    assert kube.status("m")["stages"][0]["message"] == "1 pod(s) running"  # no log to read
    kube.logs[("ns", pod, "compress")] = ("[   4.3s] round2.bld: start (1.3 GiB held)\n"
                                         "[ 121.0s] bld: 412/1536 slot 40 (attention, layer 40) gqa-4: nmse 0.02, "
                                         "eta 11400s\n")
    assert step(kube).phase == "Compressing"
    status = kube.status("m")
    compress = status["stages"][0]
    assert (compress["progress"], compress["message"]) == (0.268, "round 2/3: bld 412/1,536, eta 3h10m")
    assert status["progress"] == "Compress 27%"
    # the pod is done and the Job controller has not said how the Job ended yet: the last word stands, unwritten
    kube.patch("kubelet", "Pod", "ns", pod, {"status": {"phase": "Succeeded"}})
    kube.patch("job-controller", "Job", "ns", job, {"status": {"active": 0, "ready": 0, "succeeded": 1}})
    statuses = sum(1 for verb, _, _ in kube.writes if verb == "status")
    assert step(kube).phase == "Compressing" and kube.status("m")["stages"][0] == compress
    assert sum(1 for verb, _, _ in kube.writes if verb == "status") == statuses


def test_a_pass_looks_again_when_it_has_cause_and_writes_the_status_only_when_it_says_more(kube: FakeKube) -> None:
    """Its own writes wake no pass: a created Job is looked at again when it finishes (an event) or at the next
    progress pass, which writes nothing while there is nothing new to say; only a Job created suspended for Kueue
    is looked at again at once (its Workload, which says why it waits, wakes nothing)."""
    kube.apply(manifest())
    assert step(kube).requeue_s == PROGRESS_REQUEUE_S  # created the claim, plan and compress Job
    statuses = sum(1 for verb, _, _ in kube.writes if verb == "status")
    assert step(kube).requeue_s == PROGRESS_REQUEUE_S  # the build runs
    assert sum(1 for verb, _, _ in kube.writes if verb == "status") == statuses  # still waiting for a pod
    assert drive(kube, "Ready").requeue_s == SETTLED_REQUEUE_S  # the speed Job's end will wake it
    queued = FakeKube()
    body = manifest(name="q")
    body["spec"]["jobs"]["queueName"] = "gpu-builds"
    queued.apply(body)
    assert step(queued, "q").requeue_s == QUEUED_REQUEUE_S


def test_every_plan_the_operator_wrote_reads_back_as_the_plan_it_keeps(kube: FakeKube) -> None:
    """The build's and each pool's package plan: what a pass keeps by the text (`workloads.PLANS`) is what the
    text parses to, as the Jobs read it."""
    kube.apply(manifest())
    drive(kube, "Ready")
    assert kube.names("ConfigMap") == ["m-g1-compress", "m-g1-evaluate", "m-g1-package-h100",
                                       "m-g1-package-h100-code", "m-g1-plan", "m-g1-quantize"]  # and the records
    #                                                                                   (the a100 pool is skipped)
    texts = [data[PLAN_FILE] for name in kube.names("ConfigMap") if PLAN_FILE in (data := kube.obj("ConfigMap",
                                                                                                   name)["data"])]
    assert len(texts) == 2
    for text in texts:
        assert workloads.PLANS.get(text, lambda: None) == BuildPlan.model_validate(yaml.safe_load(text))


def test_only_the_stage_that_downloads_gets_the_hub_token(kube: FakeKube) -> None:
    """compress fetches an hf:// parent into the cache on the claim; every later stage and the speed Job read it
    there with the hub offline and never see the credentials Secret."""
    body = manifest()
    body["spec"]["source"] = {"uri": PRIVATE_PARENT, "credentialsSecret": {"name": "m-credentials"}}
    kube.apply(body)
    drive(kube, "Ready")
    seen = set()
    for name in kube.names("Job"):
        pod = kube.obj("Job", name)["spec"]["template"]["spec"]
        env = {e["name"]: e for container in pod["containers"] for e in container.get("env", [])}
        stage = kube.obj("Job", name)["metadata"]["labels"]["tailor.dev/stage"]
        seen.add(stage)
        if stage == "compress":
            assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "m-credentials"
            assert "HF_HUB_OFFLINE" not in env
        else:
            assert "HF_TOKEN" not in env and env["HF_HUB_OFFLINE"]["value"] == "1", name
    assert seen == {"compress", "quantize", "evaluate", "package", "speed"}
