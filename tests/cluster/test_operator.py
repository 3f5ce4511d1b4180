"""The operator as a subprocess against the devcluster, with kwok playing the GPU nodes: stage Jobs finish at
once and hand back the results the test puts in `devcluster.tailor.dev/result-<stage>` pod annotations (kwok
writes them as the termination message); Triton pods become Ready without running. What is real: the API
server, the Job, Deployment, HPA and garbage-collection controllers, the scheduler, and the operator."""

from __future__ import annotations

import base64
import contextlib
import gzip
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.devcluster.simulated import RESULT_ANNOTATION, published_results
from tailor.operator import api as model
from tailor.operator import names, wire

from cmodels import OBJECTS, cmodel, events, h100_example, jobs, wait_phase
from conftest import REPO, wait_for

COMPRESS_RESULT = RESULT_ANNOTATION.format(stage="compress")


def example(name: str, annotations: dict[str, str], **deployment: Any) -> dict[str, Any]:
    """The H100 example on an H100 and an A100-40GB pool."""
    body = h100_example(name, annotations)
    spec = body["spec"]
    spec["deployment"]["pools"] = [
        {"name": "h100", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
         "concurrency": {"perNode": 16}},
        {"name": "a100", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"},
         "concurrency": {"perNode": 8}}]
    spec["deployment"].update({"maxReplicas": 8, **deployment})
    return body


def test_lifecycle_sizes_pools_and_serves(api: client.ApiClient, namespace: str, operator: Any) -> None:
    objects = client.CustomObjectsApi(api)
    OBJECTS.create(objects, namespace, example("super", published_results()))
    ready = wait_phase(objects, namespace, "super", "Ready", operator)
    status = ready["status"]
    # kopf keeps its finalizer there and no copy of the spec it last handled (the operator has no update handlers)
    assert ready["metadata"]["finalizers"] == ["tailor.dev/finalizer"]
    assert not [key for key in ready["metadata"].get("annotations") or {} if key.startswith("tailor.dev/")]
    pools = {p["name"]: p for p in status["pools"]}
    assert pools["h100"]["concurrencyPerGpu"] == 8  # the published 8 concurrent 1M-token requests per H100
    assert pools["h100"]["gpusPerReplica"] == 1 and pools["h100"]["replicas"] == 4  # 2 nodes x 16 / 8
    assert pools["h100"]["readyReplicas"] == 4 and pools["h100"]["revision"] == "g1"
    assert "no FP8 math" in pools["a100"]["skipped"]
    assert status["architecture"]["totalParamsBillions"] == pytest.approx(75.35)
    assert status["architecture"]["precision"] == "nvfp4-mamba-moe"
    assert status["quality"]["passed"] is True
    assert [s["state"] for s in status["stages"]] == ["Succeeded"] * 4
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True" and conditions["Ready"]["observedGeneration"] == 1
    assert {(e["protocol"], e["url"]) for e in status["endpoints"]} == {
        ("http", f"super-h100.{namespace}.svc:8000"), ("grpc", f"super-h100.{namespace}.svc:8001"),
        ("openai", f"super-h100.{namespace}.svc:9000")}  # the OpenAI-compatible API beside Triton

    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    deployment = apps.read_namespaced_deployment("super-h100-g1", namespace)
    container = deployment.spec.template.spec.containers[0]
    assert container.resources.requests["nvidia.com/gpu"] == "1"
    folder = f"super-{ready['metadata']['uid'][:8]}"  # the object's own folder on the claim
    assert container.args[0] == f"--model-repository=/models/{folder}/g1/triton-h100/repository"
    assert core.read_namespaced_service("super-h100", namespace).spec.selector["tailor.dev/revision"] == "g1"
    hpa = client.AutoscalingV2Api(api).read_namespaced_horizontal_pod_autoscaler("super-h100-g1", namespace)
    assert hpa.spec.max_replicas == 8
    assert not apps.list_namespaced_deployment(namespace, label_selector="tailor.dev/pool=a100").items
    assert sorted(jobs(api, namespace)) == ["super-g1-compress", "super-g1-evaluate", "super-g1-package-h100",
                                            "super-g1-quantize", "super-g1-speed-h100"]
    # the speed Job (kwok ends it with the devcluster's "not measured" result): the status says so, still Ready
    speed = client.BatchV1Api(api).read_namespaced_job("super-g1-speed-h100", namespace).spec.template.spec
    assert speed.init_containers[0].restart_policy == "Always" and speed.share_process_namespace

    def recorded() -> dict[str, Any] | None:
        found = objects.get_namespaced_custom_object("tailor.dev", "v1alpha1", namespace, "compressedmodels",
                                                     "super")["status"]
        return found if (found.get("servedSpeedup") or {}).get("state") not in (None, "Running") else None

    measured = wait_for("the served speed-up to be recorded", recorded, timeout_s=60)
    assert measured["servedSpeedup"]["state"] == "NotMeasured" and measured["phase"] == "Ready"
    assert "simulated pool" in measured["servedSpeedup"]["message"]
    # the pods that load the checkpoint get no egress: the API server took the operator's NetworkPolicy
    policy = client.NetworkingV1Api(api).read_namespaced_network_policy("super-no-egress", namespace)
    assert policy.spec.policy_types == ["Egress"] and not policy.spec.egress
    selector = policy.spec.pod_selector.match_labels
    assert (selector["tailor.dev/model"], selector["tailor.dev/egress"]) == ("super", "none")
    assert deployment.spec.template.metadata.labels["tailor.dev/egress"] == "none"
    # and only the namespace and the monitoring stack reach them
    ingress = client.NetworkingV1Api(api).read_namespaced_network_policy("super-ingress", namespace).spec
    assert ingress.policy_types == ["Ingress"] and ingress.pod_selector.match_labels == selector
    assert [peer.namespace_selector.match_expressions[0].values if peer.namespace_selector else "namespace"
            for peer in ingress.ingress[0]._from] == ["namespace", ["monitoring"]]
    compress = client.BatchV1Api(api).read_namespaced_job("super-g1-compress", namespace).spec.template.spec
    terms = compress.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    assert {"NVIDIA-H100-80GB-HBM3", "nvidia-h100-80gb", "p5.48xlarge"} <= {
        value for term in terms for expression in term.match_expressions for value in expression.values}
    assert compress.containers[0].command[:3] == ["tailor", "compress", "--plan"]
    assert {"JobCreated", "QualityGatePassed", "Ready"} <= set(events(api, namespace, "super"))
    metrics = operator.get(operator.metrics_port, "/metrics")
    assert 'tailor_compressedmodels{phase="Ready"} 1.0' in metrics and "tailor_reconciles_total" in metrics
    assert "tailor_api_requests_total" in metrics
    assert operator.get(operator.liveness_port, "/healthz")  # kopf's liveness probe answers


def test_failing_job_is_retried_then_fails(api: client.ApiClient, namespace: str, operator: Any) -> None:
    objects = client.CustomObjectsApi(api)
    OBJECTS.create(objects, namespace, example("broken", {"devcluster.tailor.dev/fail": "CUDA out of memory"}))
    failed = wait_phase(objects, namespace, "broken", "Failed", operator)
    conditions = {c["type"]: c for c in failed["status"]["conditions"]}
    assert conditions["Failed"]["reason"] == "BackoffLimitExceeded"
    assert "CUDA out of memory" in conditions["Failed"]["message"]
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector="tailor.dev/stage=compress").items
    assert len(pods) == 2  # the first try and backoffLimit 1 retry
    assert jobs(api, namespace) == ["broken-g1-compress"]  # nothing after the failed stage
    # fixing what failed is a new generation with the same build inputs: the build is retried
    fixed = {"devcluster.tailor.dev/fail": None, **published_results()}  # a merge patch: null removes the failing one
    OBJECTS.patch(objects, namespace, "broken", {"spec": {"jobs": {"podAnnotations": fixed}}})
    ready = wait_phase(objects, namespace, "broken", "Ready", operator, generation=2)
    assert ready["status"]["build"]["generation"] == 2 and "broken-g2-compress" in jobs(api, namespace)


def test_updates_gate_and_rollout(api: client.ApiClient, namespace: str, operator: Any) -> None:
    """A deployment-only change rolls out a new revision without recompressing; a change that fails the quality
    gate leaves the serving revision alone."""
    objects = client.CustomObjectsApi(api)
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    OBJECTS.create(objects, namespace, example("m", published_results()))
    wait_phase(objects, namespace, "m", "Ready", operator)

    OBJECTS.patch(objects, namespace, "m", {"spec": {"deployment": {"maxReplicas": 2}}})
    ready = wait_phase(objects, namespace, "m", "Ready", operator, generation=2)
    assert ready["status"]["servingGeneration"] == 2 and ready["status"]["build"]["generation"] == 1
    assert [d.metadata.name for d in apps.list_namespaced_deployment(namespace).items] == ["m-h100-g2"]
    assert apps.read_namespaced_deployment("m-h100-g2", namespace).spec.replicas == 2
    assert core.read_namespaced_service("m-h100", namespace).spec.selector["tailor.dev/revision"] == "g2"
    assert "m-g2-compress" not in jobs(api, namespace)  # no recompression for a deployment-only change
    assert "TrafficSwitched" in events(api, namespace, "m")

    OBJECTS.patch(objects, namespace, "m", {"spec": {"compression": {"rounds": 2},
                                                     "jobs": {"podAnnotations": published_results(passed=False)}}})
    failed = wait_phase(objects, namespace, "m", "Failed", operator, generation=3)
    conditions = {c["type"]: c for c in failed["status"]["conditions"]}
    assert conditions["Failed"]["reason"] == "QualityGateFailed"
    assert conditions["Ready"]["status"] == "True"  # generation 2 keeps serving
    assert failed["status"]["servingGeneration"] == 2
    assert [d.metadata.name for d in apps.list_namespaced_deployment(namespace).items] == ["m-h100-g2"]
    assert core.read_namespaced_service("m-h100", namespace).spec.selector["tailor.dev/revision"] == "g2"
    assert "m-g3-compress" in jobs(api, namespace)


def test_restart_mid_compression_adopts_the_job(api: client.ApiClient, namespace: str, operator: Any) -> None:
    objects, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    held = {**published_results(), "devcluster.tailor.dev/hold": "until the test lets go"}
    OBJECTS.create(objects, namespace, example("r", held))
    wait_phase(objects, namespace, "r", "Compressing", operator)
    operator.kill()
    operator.start()
    _running_compress_pod(core, namespace)

    def release_held_pods() -> bool:  # each stage's pod carries the hold: let each go as it comes
        for pod in core.list_namespaced_pod(namespace).items:
            if "devcluster.tailor.dev/hold" in (pod.metadata.annotations or {}) and pod.status.phase == "Running":
                core.patch_namespaced_pod(pod.metadata.name, namespace,
                                          {"metadata": {"annotations": {"devcluster.tailor.dev/hold": None}}})
        status = (cmodel(objects, namespace, "r") or {}).get("status") or {}
        return status.get("phase") == "Ready"

    wait_for("r to become Ready", release_held_pods, timeout_s=90)
    assert jobs(api, namespace).count("r-g1-compress") == 1
    assert len(core.list_namespaced_pod(namespace, label_selector="tailor.dev/stage=compress").items) == 1


def test_delete_mid_compression_leaves_nothing(api: client.ApiClient, namespace: str, operator: Any) -> None:
    objects, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    OBJECTS.create(objects, namespace, example("d", {"devcluster.tailor.dev/hold": "forever"}))
    wait_phase(objects, namespace, "d", "Compressing", operator)
    _running_compress_pod(core, namespace)
    OBJECTS.delete(objects, namespace, "d")
    wait_for("the CompressedModel to go", lambda: not cmodel(objects, namespace, "d"), timeout_s=60)
    wait_for("its Jobs and pods to go", lambda: not jobs(api, namespace) and not core.list_namespaced_pod(
        namespace).items, timeout_s=60)
    assert not core.list_namespaced_config_map(namespace, label_selector="tailor.dev/model=d").items
    # deletionPolicy Retain (the default): the artifacts claim stays
    assert core.read_namespaced_persistent_volume_claim("d-artifacts", namespace)


def test_update_during_deploying_and_two_objects(api: client.ApiClient, namespace: str, operator: Any) -> None:
    objects, apps = client.CustomObjectsApi(api), client.AppsV1Api(api)
    OBJECTS.create(objects, namespace, example("a", published_results()))
    OBJECTS.create(objects, namespace, example("b", published_results(), maxReplicas=3))
    wait_phase(objects, namespace, "a", "Deploying", operator)
    OBJECTS.patch(objects, namespace, "a", {"spec": {"deployment": {"maxReplicas": 3}}})
    a = wait_phase(objects, namespace, "a", "Ready", operator, generation=2)
    b = wait_phase(objects, namespace, "b", "Ready", operator)
    assert a["status"]["servingGeneration"] == 2 and b["status"]["servingGeneration"] == 1
    deployed = sorted(d.metadata.name for d in apps.list_namespaced_deployment(namespace).items)
    assert deployed == ["a-h100-g2", "b-h100-g1"]
    assert all(d.spec.replicas == 3 for d in apps.list_namespaced_deployment(namespace).items)


def _running_compress_pod(core: client.CoreV1Api, namespace: str) -> str:
    def running() -> str | None:
        pods = core.list_namespaced_pod(namespace, label_selector="tailor.dev/stage=compress").items
        return next((p.metadata.name for p in pods if p.status.phase == "Running"), None)

    name: str = wait_for("the compression pod to run", running, timeout_s=60)
    return name



def test_recreated_object_waits_for_its_old_claim_to_go(api: client.ApiClient, namespace: str,
                                                        operator: Any) -> None:
    """Deleted with deletionPolicy Delete and created again at once: while the old claim is still being deleted
    (a pod uses it), the new object starts no Job; then it gets a claim of its own and reaches Ready."""
    objects, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    body = example("r", published_results())
    body["spec"]["storage"] = {"deletionPolicy": "Delete"}
    OBJECTS.create(objects, namespace, body)
    wait_phase(objects, namespace, "r", "Ready", operator)
    old = core.read_namespaced_persistent_volume_claim("r-artifacts", namespace).metadata.uid
    core.create_namespaced_pod(namespace, {  # keeps the claim in use, so its deletion waits (pvc-protection)
        "metadata": {"name": "reader"},
        "spec": {"nodeSelector": {"type": "kwok"}, "tolerations": [{"operator": "Exists"}],
                 "containers": [{"name": "c", "image": "busybox", "volumeMounts": [{"name": "a", "mountPath": "/a"}]}],
                 "volumes": [{"name": "a", "persistentVolumeClaim": {"claimName": "r-artifacts"}}]}})
    wait_for("the reader to run", lambda: core.read_namespaced_pod("reader", namespace).status.phase == "Running")
    OBJECTS.delete(objects, namespace, "r")
    wait_for("the CompressedModel to go", lambda: not cmodel(objects, namespace, "r"), timeout_s=60)
    assert core.read_namespaced_persistent_volume_claim("r-artifacts", namespace).metadata.deletion_timestamp

    OBJECTS.create(objects, namespace, body)
    waiting = wait_for("the new object to wait for the claim", lambda: next(
        (s for s in ((cmodel(objects, namespace, "r") or {}).get("status") or {}).get("stages", [])
         if "being deleted" in (s.get("message") or "")), None), timeout_s=60)
    assert waiting["name"] == "Compress" and not jobs(api, namespace)
    core.delete_namespaced_pod("reader", namespace, grace_period_seconds=0)
    wait_phase(objects, namespace, "r", "Ready", operator, timeout_s=120)
    assert core.read_namespaced_persistent_volume_claim("r-artifacts", namespace).metadata.uid != old


def test_pools_are_found_as_gke_eks_and_gfd_label_their_nodes(api: client.ApiClient, namespace: str,
                                                              operator: Any) -> None:
    """Nodes labelled as GKE labels them without the GPU Operator, as EKS does with the device plugin only, and by
    GFD's other name for an H100: each pool is sized as its GPU and serves; a MIG pool is skipped, saying why; the
    build's Jobs land on H100 nodes through node affinity, whichever label names the GPU."""
    objects, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    body = h100_example("clouds", published_results())
    body["spec"]["deployment"]["pools"] = [{"name": pool, "nodeSelector": {"tailor.dev/node-pool": pool},
                                            "concurrency": {"perNode": 8}}
                                           for pool in ("gke-h100", "eks-h200", "h100-sxm5", "a100-mig")]
    OBJECTS.create(objects, namespace, body)
    ready = wait_phase(objects, namespace, "clouds", "Ready", operator)
    pools = {p["name"]: p for p in ready["status"]["pools"]}
    assert (pools["gke-h100"]["gpuProduct"], pools["gke-h100"]["concurrencyPerGpu"]) == ("nvidia-h100-80gb", 8)
    assert pools["eks-h200"]["gpuProduct"] == "p5e.48xlarge" and pools["eks-h200"]["concurrencyPerGpu"] > 8
    assert pools["h100-sxm5"]["gpuProduct"] == "NVIDIA-H100-SXM5-80GB"
    for name in ("gke-h100", "eks-h200", "h100-sxm5"):
        assert pools[name]["readyReplicas"] == pools[name]["replicas"] == 1 and pools[name]["revision"] == "g1"
    assert "partitions its GPUs with MIG" in pools["a100-mig"]["skipped"]
    catalog = GpuCatalog.load()
    for stage in ("compress", "quantize", "evaluate"):
        (pod,) = core.list_namespaced_pod(namespace,
                                          label_selector=f"batch.kubernetes.io/job-name=clouds-g1-{stage}").items
        found = catalog.for_node(core.read_node(pod.spec.node_name).metadata.labels)
        assert found is not None and found[0].name == "H100-80GB", (stage, pod.spec.node_name)


@contextlib.contextmanager
def training_pod(core: client.CoreV1Api, namespace: str, gpus: int) -> Iterator[str]:
    """A pod of another namespace (yielded) holding `gpus` of the 8 GPUs of the eks-h200 pool's one node."""
    (node,) = core.list_node(label_selector="tailor.dev/node-pool=eks-h200").items
    other = f"{namespace}-other"
    core.create_namespace({"metadata": {"name": other}})
    try:
        core.create_namespaced_pod(other, {"metadata": {"name": "training"}, "spec": {
            "nodeName": node.metadata.name,
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "train", "image": "example.com/train:1",
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}})
        yield other
    finally:
        core.delete_namespace(other)


def test_a_pool_is_sized_by_the_gpus_other_pods_leave_free(api: client.ApiClient, namespace: str,
                                                           operator: Any) -> None:
    """A pod of another namespace bound to the pool's one node holds 5 of its 8 GPUs: the pool is sized for the
    3 left (not 8), says who holds the rest, and all 3 replicas run beside that pod."""
    objects, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    with training_pod(core, namespace, 5) as other:
        wait_for("kwok to run the pod", lambda: core.read_namespaced_pod("training", other).status.phase == "Running")
        body = h100_example("busy", published_results())
        body["spec"]["deployment"]["pools"] = [{"name": "h200", "nodeSelector": {"tailor.dev/node-pool": "eks-h200"},
                                                "concurrency": {"perNode": 256}}]
        body["spec"]["deployment"]["maxReplicas"] = 8
        OBJECTS.create(objects, namespace, body)
        ready = wait_phase(objects, namespace, "busy", "Ready", operator)
        (pool,) = ready["status"]["pools"]
        assert pool["gpusPerReplica"] == 1 and pool["replicas"] == pool["readyReplicas"] == 3, pool
        assert "other pods hold 5 of the pool's 8 GPUs (on 1 node(s)): room for 3 replica(s)" in " ".join(
            pool["notes"])
        assert core.read_namespaced_pod("training", other).status.phase == "Running"


def test_a_revision_with_no_room_fails_once_and_is_made_again_when_gpus_are_free(
        api: client.ApiClient, namespace: str, operator: Any) -> None:
    """Six replicas asked of a node where another namespace's pod holds 5 of 8 GPUs: 3 run, 3 cannot be
    scheduled, and at the Deployment controller's progress deadline (shortened here) the revision fails and
    is deleted, once: no new one while there is no room (it looped every few seconds before). Once the pod is
    gone, the operator makes the revision again and the model serves."""
    objects, core, apps = client.CustomObjectsApi(api), client.CoreV1Api(api), client.AppsV1Api(api)
    with training_pod(core, namespace, 5) as other:
        body = h100_example("full", published_results())
        body["spec"]["deployment"]["pools"] = [{"name": "h200", "nodeSelector": {"tailor.dev/node-pool": "eks-h200"},
                                                "concurrency": {"perNode": 8}}]
        body["spec"]["deployment"].update(minReplicas=6, maxReplicas=6)
        OBJECTS.create(objects, namespace, body)
        revision = "full-h200-g1"
        wait_for("the revision", lambda: revision in {d.metadata.name for d in apps.list_namespaced_deployment(
            namespace).items}, timeout_s=90)
        apps.patch_namespaced_deployment(revision, namespace, {"spec": {"progressDeadlineSeconds": 5}})
        failed = wait_phase(objects, namespace, "full", "Failed", operator)
        (pool,) = failed["status"]["pools"]
        assert (pool["failed"]["deployment"], pool["failed"]["retry"], pool["failed"]["replicas"]) == (
            revision, "Capacity", 6), pool
        assert "Insufficient nvidia.com/gpu" in pool["failed"]["message"]
        time.sleep(20)  # the loop made it again within a second or two
        assert revision not in {d.metadata.name for d in apps.list_namespaced_deployment(namespace).items}
        assert events(api, namespace, "full").count("RevisionFailed") == 1
        core.delete_namespaced_pod("training", other, grace_period_seconds=0)
        ready = wait_phase(objects, namespace, "full", "Ready", operator, timeout_s=120)
        assert ready["status"]["pools"][0]["readyReplicas"] == 6 and "failed" not in ready["status"]["pools"][0]
        assert "RevisionRetried" in events(api, namespace, "full")


def test_hostile_results_fail_their_objects_and_the_operator_serves_the_rest(
        api: client.ApiClient, namespace: str, operator: Any) -> None:
    """A compress result whose child config nests 100,000 levels deep, and one whose child has a hundred million
    layers: each object ends Failed (InvalidResult) naming what is wrong, the operator neither loops nor grows (its
    peak memory stays within what it holds for a few objects), and an honest object beside them is served."""
    objects = client.CustomObjectsApi(api)
    honest = published_results()
    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 10**8,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    hostile = {"deep": b"[" * 100_000 + b"]" * 100_000, "layers": json.dumps(llama).encode()}
    for name, config in hostile.items():
        result = {**json.loads(honest[COMPRESS_RESULT]), "config": base64.b64encode(gzip.compress(config)).decode()}
        OBJECTS.create(objects, namespace, example(name, {**honest, COMPRESS_RESULT: json.dumps(result)}))
    OBJECTS.create(objects, namespace, example("honest", honest))
    says = {"deep": "nests deeper than 64 levels", "layers": "at most 4096 layers"}
    for name, expected in says.items():
        failed = wait_phase(objects, namespace, name, "Failed", operator)
        condition = next(c for c in failed["status"]["conditions"] if c["type"] == "Failed")
        assert condition["reason"] == "InvalidResult" and expected in condition["message"], condition
    wait_phase(objects, namespace, "honest", "Ready", operator)
    assert operator.process.poll() is None
    peak_mib = int(next(line.split()[1] for line in Path(f"/proc/{operator.process.pid}/status").read_text()
                        .splitlines() if line.startswith("VmHWM:"))) / 1024
    assert peak_mib < 256, f"the operator peaked at {peak_mib:.0f} MiB"  # a hundred million blocks: gigabytes
    assert "reconcile failed" not in operator.log_tail(200)


PAST_THE_PARSER = 1500  # levels: Python's json raises RecursionError at about 1,000; the API server takes 10,000


def _post_raw(kubectl: Any, namespace: str, body: str, validation: str) -> subprocess.CompletedProcess[str]:
    """POST `body` as it is (the Python client cannot even encode it) through `kubectl create --raw`."""
    path = (f"/apis/{model.GROUP}/{model.API_VERSION}/namespaces/{namespace}/{model.PLURAL}"
            f"?fieldValidation={validation}")
    return kubectl("create", "--raw", path, "-f", "-", stdin=body, check=False)  # type: ignore[no-any-return]


def _deep_body(name: str) -> str:
    """The H100 example with planOverrides nested PAST_THE_PARSER levels deep, as JSON text."""
    body = {"apiVersion": f"{model.GROUP}/{model.API_VERSION}", "kind": model.KIND,
            **example(name, published_results())}
    body["spec"]["compression"]["planOverrides"] = {"library": "DEEP"}
    return json.dumps(body).replace('"DEEP"', '{"a":' * PAST_THE_PARSER + "1" + "}" * PAST_THE_PARSER)


def test_planoverrides_nested_past_the_parser_are_refused(api: client.ApiClient, namespace: str,
                                                          kubectl: Any, crd: None) -> None:
    """The CRD types planOverrides as the plan is: strict field validation refuses what nests past it, and
    without it the API server drops it."""
    refused = _post_raw(kubectl, namespace, _deep_body("deep"), "Strict")
    assert refused.returncode != 0 and "spec.compression.planOverrides.library.a" in refused.stderr, refused.stderr
    kept = _post_raw(kubectl, namespace, _deep_body("pruned"), "Ignore")
    assert kept.returncode == 0, kept.stderr
    assert json.loads(kept.stdout)["spec"]["compression"]["planOverrides"] == {"library": {}}


def _read(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """The object as the operator reads it (`wire.loads`: what nests past 64 levels read as a string)."""
    try:
        response = client.CustomObjectsApi(api).get_namespaced_custom_object(
            model.GROUP, model.API_VERSION, namespace, model.PLURAL, name, _preload_content=False)
    except client.ApiException as error:
        if error.status == 404:
            return None
        raise
    return wire.loads(response.data)  # type: ignore[no-any-return]


def test_an_object_nested_past_the_parser_fails_alone_and_the_operator_serves_the_rest(
        api: client.ApiClient, namespace: str, operator: Any, kubectl: Any) -> None:
    """An object stored while planOverrides took anything (as the CRD of earlier releases let it, put back here
    for the test): the operator reads it with what nests too deep cut, fails it (InvalidSpec) naming the field,
    serves an honest object beside it, and neither exits nor restarts; deleting it runs its finalizer."""
    objects = client.CustomObjectsApi(api)
    field = "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/compression/properties/planOverrides"
    kubectl("patch", f"crd/{model.PLURAL}.{model.GROUP}", "--type=json", "-p", json.dumps([
        {"op": "add", "path": f"{field}/x-kubernetes-preserve-unknown-fields", "value": True},
        {"op": "add", "path": f"{field}/properties/library/x-kubernetes-preserve-unknown-fields", "value": True}]))
    try:
        wait_for("the deep object to be taken", lambda: _post_raw(
            kubectl, namespace, _deep_body("deep"), "Strict").returncode == 0, timeout_s=30)
        OBJECTS.create(objects, namespace, example("honest", published_results()))
        failed = wait_for("the deep object to fail", lambda: (
            (found := _read(api, namespace, "deep")) and (found.get("status") or {}).get("phase") == "Failed"
            and found), timeout_s=90)
        condition = next(c for c in failed["status"]["conditions"] if c["type"] == "Failed")
        assert condition["reason"] == "InvalidSpec" and "planOverrides nests" in condition["message"], condition
        wait_phase(objects, namespace, "honest", "Ready", operator)
        assert operator.process.poll() is None, operator.log_tail()
        kubectl("delete", model.PLURAL, "deep", "-n", namespace, "--timeout=60s")
        assert _read(api, namespace, "deep") is None
    finally:
        kubectl("delete", model.PLURAL, "deep", "-n", namespace, "--ignore-not-found", "--timeout=60s", check=False)
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds" / "compressedmodel.yaml"))
    assert "reconcile failed" not in operator.log_tail(200)


def _admins_objects() -> dict[str, dict[str, Any]]:
    """A namespace admin's own objects, each named as the operator names one of a CompressedModel's (the model is
    the key): the operator must neither take them for its own nor delete or change them."""
    web = {"matchLabels": {"app": "web"}}
    return {
        "np": {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
               "metadata": {"name": names.ingress_policy_name("np")},
               "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}},  # the admin's default-deny
        "svc": {"apiVersion": "v1", "kind": "Service", "metadata": {"name": names.service_name("svc", "h100")},
                "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}},
        "pdb": {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": {"name": names.revision_name("pdb", "h100", 1)},
                "spec": {"minAvailable": 1, "selector": web}},
        "hpa": {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": names.revision_name("hpa", "h100", 1)},
                "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web"},
                         "minReplicas": 1, "maxReplicas": 2}},
        "cm": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": names.plan_name("cm", 1)},
               "data": {"owner": "admin"}},
        "pvc": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": names.claim_name("pvc")},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}},
    }


def _as_found(kubectl: Any, namespace: str, kind: str, name: str) -> tuple[str, list[Any], Any]:
    """An object's uid, owner references and spec (or data) as the API server has it; a claim's volume, which the
    volume controller binds whenever it comes to it, left out."""
    found = json.loads(kubectl("get", kind, name, "-n", namespace, "-o", "json").stdout)
    content = {key: value for key, value in found.get("spec", found.get("data")).items() if key != "volumeName"}
    return found["metadata"]["uid"], found["metadata"].get("ownerReferences") or [], content


def test_objects_named_like_a_models_are_never_taken_changed_or_deleted(
        api: client.ApiClient, namespace: str, operator: Any, kubectl: Any) -> None:
    """Each model finds another's object where one of its own would go: it fails (OwnedElsewhere) naming it, and
    neither that failure, nor removing the deployment, nor deleting the model touches the admin's object."""
    objects = client.CustomObjectsApi(api)
    admins = _admins_objects()
    kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                   "items": list(admins.values())}))
    before = {model_name: _as_found(kubectl, namespace, o["kind"], o["metadata"]["name"])
              for model_name, o in admins.items()}
    for model_name in admins:
        OBJECTS.create(objects, namespace, example(model_name, published_results()))
    for model_name, theirs in admins.items():
        failed = wait_phase(objects, namespace, model_name, "Failed", operator)
        condition = next(c for c in failed["status"]["conditions"] if c["type"] == "Failed")
        said = f"{theirs['kind']} {theirs['metadata']['name']} exists and"
        assert condition["reason"] == "OwnedElsewhere" and said in condition["message"], condition
    OBJECTS.patch(objects, namespace, "np", {"spec": {"deployment": None}})  # serving goes: its policies with it
    wait_phase(objects, namespace, "np", "Ready", operator, generation=2)
    for model_name in admins:
        OBJECTS.delete(objects, namespace, model_name)
    wait_for("the models to go", lambda: not any(cmodel(objects, namespace, m) for m in admins), timeout_s=60)
    after = {model_name: _as_found(kubectl, namespace, o["kind"], o["metadata"]["name"])
             for model_name, o in admins.items()}
    assert after == before
    assert "reconcile failed" not in operator.log_tail(200)
