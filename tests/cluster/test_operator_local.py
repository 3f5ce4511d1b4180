"""The whole lifecycle for real on the devcluster's executor node (`local-0`, this machine), with the operator
installed by the Helm chart: its pod runs there too, under the chart's ServiceAccount token, so the lifecycle
passes with exactly the chart's permissions. The operator's Jobs run `tailor compress`, `tailor quantize` (FP8,
emulated on the `cpu` profile) and `tailor evaluate` on the toy NemotronH hybrid, a package Job writes the
Triton model repository, and the Deployment's pod is a real tritonserver that answers an inference (the Python
fallback engine: vLLM's CPU build runs no MoE layers)."""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tailor.compressor.serving.client import infer

from cmodels import OBJECTS, cmodel, jobs, wait_phase
from conftest import wait_for

# the toy hybrid has MoE layers, which the `cpu` pool serves with the Python fallback engine: compressed for it (a
# plan for vLLM keeps every block of a hybrid, and the toy then reaches no 1.05x)
PLAN = {"engine": "tailor-python", "data": {"seqLen": 64}, "target": {"costs": "roofline"},
        "library": {"keepAttention": False},
        "bld": {"lr": 0.001, "batch": 4},
        "bldActivationTokens": 512, "scoringTokens": 256, "evalTokens": 256, "gkd": {"lr": 0.0001, "batch": 4},
        "measureTokens": 4, "measureContext": 128}


def _source_claim(core: client.CoreV1Api, namespace: str, parent: Path) -> None:
    """A claim holding the parent, as a platform team would stage weights: the provisioner binds it to a folder."""
    core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": "models", "labels": {"tailor.dev/allowed": "true"},
                     "annotations": {"tailor.dev/shared-with": "*"}},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    claim = wait_for("the models claim to bind", lambda: core.read_namespaced_persistent_volume_claim(
        "models", namespace).spec.volume_name, timeout_s=30)
    folder = Path(core.read_persistent_volume(claim).spec.host_path.path)
    shutil.copytree(parent, folder / "tiny-nemotron-h")


@pytest.mark.timeout(900)  # real compress, quantize, evaluate and package Jobs of the tiny hybrid, then vLLM
def test_jobs_run_and_triton_answers(api: client.ApiClient, namespace: str, installed_operator: Any,
                                     tiny_hybrid: Path) -> None:
    core, objects = client.CoreV1Api(api), client.CustomObjectsApi(api)
    _source_claim(core, namespace, tiny_hybrid)
    OBJECTS.create(objects, namespace, {"metadata": {"name": "toy"}, "spec": {
        "source": {"uri": "pvc://models/tiny-nemotron-h"},
        "compression": {"targetGPU": "cpu", "throughputFactor": 1.05, "contextLength": 256, "rounds": 1,
                        "minQualityRetention": 0.5, "planOverrides": PLAN,
                        "distillation": {"blockwiseTokens": 1024, "globalTokens": 2048}},
        "quantization": {"precision": "fp8", "calibrationSamples": 2},
        "deployment": {"pools": [{"name": "local", "nodeSelector": {"nvidia.com/gpu.product": "tailor-local-cpu"},
                                  "concurrency": {"total": 4}}],
                       "contextLength": 256, "minReplicas": 1, "maxReplicas": 1},
        "storage": {"deletionPolicy": "Delete"}}})
    seen: set[tuple[str, str]] = set()  # (status.progress, the compress stage's message) while it runs
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.5):
            status = (cmodel(objects, namespace, "toy") or {}).get("status") or {}
            compress = next((s for s in status.get("stages") or [] if s["name"] == "Compress"), {})
            seen.add((status.get("progress") or "", compress.get("message") or ""))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        ready = wait_phase(objects, namespace, "toy", "Ready", installed_operator, timeout_s=780)
    finally:
        stop.set()
        watcher.join()
    status = ready["status"]
    # while it ran, the compress stage said which step its log was at (read through the executor's kubelet
    # endpoint with the chart's pods/log right), and `kubectl get`'s Progress column how far
    steps = [(shown, message) for shown, message in seen
             if re.fullmatch(r"round 1/1: [a-z]+ [\d,]+/[\d,]+( variants)?(, eta \w+)?", message)]
    assert steps, sorted(seen)
    assert all(re.fullmatch(r"Compress \d+%", shown) for shown, _ in steps), steps
    assert jobs(api, namespace) == ["toy-g1-compress", "toy-g1-evaluate", "toy-g1-package-local", "toy-g1-quantize"]
    assert status["quality"]["passed"] is True and status["quality"]["retention"] >= 0.5
    assert status["architecture"]["precision"].startswith("fp8") and status["architecture"]["blocks"] == 8
    (pool,) = status["pools"]
    assert pool["readyReplicas"] == 1 and pool["revision"] == "g1"
    # vLLM here runs no NemotronH Puzzle child: the toy hybrid's is served by the Python fallback engine, and status
    # says so
    assert pool["engine"] == "tailor-python" and "Python fallback engine" in " ".join(pool["notes"])
    # the served speed-up is measured through vLLM only: no speed Job, and the status says why
    assert status["servedSpeedup"]["state"] == "NotMeasured" and "tailor-python" in status["servedSpeedup"]["message"]

    (pod,) = core.list_namespaced_pod(namespace, label_selector="tailor.dev/pool=local").items
    assert pod.spec.node_name == "local-0"
    ports = json.loads(pod.metadata.annotations["devcluster.tailor.dev/ports"])
    answer = infer(f"127.0.0.1:{ports['http']}", "toy", "http", "ROMEO:", max_tokens=8)
    assert len(answer.ids) == 8 and answer.text

    # the code it serves is what the package Job wrote: a model.py changed on the claim since stops the next
    # replica before Triton starts, naming the file
    revision = client.AppsV1Api(api).read_namespaced_deployment("toy-local-g1", namespace)
    (triton, *_) = revision.spec.template.spec.containers
    repository = next(arg for arg in triton.args if arg.startswith("--model-repository=")).split("=", 1)[1]
    volume = core.read_namespaced_persistent_volume_claim("toy-artifacts", namespace).spec.volume_name
    model_py = (Path(core.read_persistent_volume(volume).spec.host_path.path) / Path(repository).relative_to("/models")
                / "toy" / "1" / "model.py")
    model_py.write_text(model_py.read_text() + "\nprint('not what was packaged')\n")
    core.delete_namespaced_pod(pod.metadata.name, namespace)

    def refused() -> Any:
        for replica in core.list_namespaced_pod(namespace, label_selector="tailor.dev/pool=local").items:
            for state in replica.status.container_statuses or [] if replica.metadata.uid != pod.metadata.uid else []:
                if state.name == "triton" and (ended := state.state.terminated or state.last_state.terminated):
                    return ended
        return None

    ended = wait_for("the new replica to refuse the changed code", refused, timeout_s=90)
    assert ended.exit_code == 3 and "repository/toy/1/model.py: FAILED" in ended.message, ended.message

    OBJECTS.delete(objects, namespace, "toy")  # deletionPolicy Delete: the artifacts claim goes with it
    wait_for("the model's pods to stop", lambda: not core.list_namespaced_pod(
        namespace, label_selector="tailor.dev/model=toy").items, timeout_s=90)

    def claim_deleted() -> bool:
        try:
            claim = core.read_namespaced_persistent_volume_claim("toy-artifacts", namespace)
        except client.ApiException as error:
            return error.status == 404
        return claim.metadata.deletion_timestamp is not None

    wait_for("the artifacts claim to be deleted", claim_deleted, timeout_s=30)
    assert core.read_namespaced_persistent_volume_claim("models", namespace)  # not Tailor's: kept
