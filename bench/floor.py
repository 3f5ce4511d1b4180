"""The floor for `bench/operator.py`: a minimal controller that makes each CompressedModel Ready with only the
writes Tailor must do, and nothing Tailor decides in between (no plan resolution, sizing, pre-flight checks, result
parsing, status history, events).

Per model, as each step's object finishes: the artifacts claim, the plan ConfigMap, the stage ServiceAccount and
the compress Job; then the quantize and evaluate Jobs; then per pool a package Job, then the serving
ServiceAccount, the no-egress NetworkPolicy, a one-replica Deployment with its PodDisruptionBudget,
HorizontalPodAutoscaler and Service (the objects Tailor creates per pool, with fewer fields); then the status patch
`phase: Ready`. The Jobs are Tailor's own manifests (`jobs.stage_job`, with the model's pod annotations: kwok
finishes them as it finishes Tailor's). Events come from three watches (models, Jobs, Deployments) and wake the
model's step on a pool of worker threads, as kopf's daemons do for the operator. It runs as a process of its own, as
the operator does, until SIGTERM:

    python bench/floor.py --kubeconfig FILE --namespace bench
"""

from __future__ import annotations

import argparse
import queue
import signal
import threading
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from tailor.compressor.hardware import GpuCatalog
from tailor.operator import api as model
from tailor.operator import names
from tailor.operator.deployment import SERVING_SERVICE_ACCOUNT, egress_policy
from tailor.operator.jobs import JOB_SERVICE_ACCOUNT, JobSettings, gpu_terms, stage_job
from tailor.operator.placement import pod_metadata, scheduling

WORKERS = 8
CATALOG = GpuCatalog.load()
STAGES = ("compress", "quantize", "evaluate")


class Floor:
    """Runs until `stop()`; `api` is the devcluster's admin client, `namespace` the benchmark's."""

    def __init__(self, api: client.ApiClient, namespace: str, image: str) -> None:
        self.api, self.namespace, self.image = api, namespace, image
        self.core, self.batch, self.apps = client.CoreV1Api(api), client.BatchV1Api(api), client.AppsV1Api(api)
        self.objects = client.CustomObjectsApi(api)
        self.networking, self.policy = client.NetworkingV1Api(api), client.PolicyV1Api(api)
        self.autoscaling = client.AutoscalingV2Api(api)
        self.models: dict[str, dict[str, Any]] = {}
        self.done: dict[str, set[str]] = {}  # model -> finished Jobs and available Deployments
        self.ready: set[str] = set()
        self.created: set[tuple[str, str]] = set()  # (kind, name) of every object created
        self.lock = threading.Lock()
        self.work: queue.Queue[str | None] = queue.Queue()
        self.watches: list[watch.Watch] = []
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(WORKERS)]
        self.threads += [threading.Thread(target=self._watch, args=watched, daemon=True) for watched in (
            (self._on_model, self.objects.list_namespaced_custom_object, model.GROUP, model.VERSION, namespace,
             model.PLURAL),
            (self._on_job, self.batch.list_namespaced_job, namespace),
            (self._on_deployment, self.apps.list_namespaced_deployment, namespace))]
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopped.set()
        for stream in self.watches:
            stream.stop()
        for _ in range(WORKERS):
            self.work.put(None)

    # --- events -----------------------------------------------------------------------------------

    def _watch(self, handle: Any, lister: Any, *args: Any) -> None:
        """Hand each event of a watch to `handle` until stopped; a watch the API server closes (a slow watcher is
        cut off under load) is opened again, and its first events list what is there (the handlers take an
        event twice as once). The devcluster going down at the end ends it too."""
        while not self.stopped.is_set():
            stream = watch.Watch()
            self.watches.append(stream)
            try:
                for event in stream.stream(lister, *args, timeout_seconds=3600):
                    handle(event)
            except Exception:
                if not self.stopped.is_set():
                    raise

    def _on_model(self, event: dict[str, Any]) -> None:
        body = event["object"]
        name = body["metadata"]["name"]
        with self.lock:
            if event["type"] == "ADDED" and name not in self.models:
                self.models[name], self.done[name] = body, set()
                self.work.put(name)

    def _owner(self, labels: dict[str, str] | None) -> str | None:
        return (labels or {}).get(names.MODEL)

    def _on_job(self, event: dict[str, Any]) -> None:
        job = event["object"]
        owner = self._owner(job.metadata.labels)
        if owner is not None and any(c.type == "Complete" and c.status == "True"
                                     for c in (job.status.conditions or [])):
            self._finished(owner, job.metadata.name)

    def _on_deployment(self, event: dict[str, Any]) -> None:
        deployment = event["object"]
        owner = self._owner(deployment.metadata.labels)
        if owner is not None and (deployment.status.available_replicas or 0) >= 1:
            self._finished(owner, deployment.metadata.name)

    def _finished(self, owner: str, name: str) -> None:
        with self.lock:
            if owner in self.done and name not in self.done[owner]:
                self.done[owner].add(name)
                self.work.put(owner)

    # --- steps ------------------------------------------------------------------------------------

    def _worker(self) -> None:
        while (name := self.work.get()) is not None:
            with self.lock:
                body, done = self.models[name], set(self.done[name])
            if name not in self.ready:
                self._step(body, done)

    def _create(self, manifest: dict[str, Any]) -> None:
        """Create `manifest` once: a step woken again (or on two workers at once) sends no second request."""
        key = (manifest["kind"], manifest["metadata"]["name"])
        with self.lock:
            if key in self.created:
                return
            self.created.add(key)
        try:
            client_for = {"Job": self.batch.create_namespaced_job, "ConfigMap": self.core.create_namespaced_config_map,
                          "PersistentVolumeClaim": self.core.create_namespaced_persistent_volume_claim,
                          "ServiceAccount": self.core.create_namespaced_service_account,
                          "Deployment": self.apps.create_namespaced_deployment,
                          "Service": self.core.create_namespaced_service,
                          "NetworkPolicy": self.networking.create_namespaced_network_policy,
                          "PodDisruptionBudget": self.policy.create_namespaced_pod_disruption_budget,
                          "HorizontalPodAutoscaler": self.autoscaling.create_namespaced_horizontal_pod_autoscaler,
                          }[manifest["kind"]]
            client_for(self.namespace, manifest)
        except ApiException as error:
            if error.status != 409:  # a ServiceAccount left from before is fine
                raise

    def _step(self, body: dict[str, Any], done: set[str]) -> None:
        name, spec = body["metadata"]["name"], model.CompressedModelSpec.model_validate(body["spec"])
        assert spec.deployment is not None
        owned = {"name": name, "namespace": self.namespace, "labels": names.model_labels(body)}
        jobs = [names.job_name(name, 1, stage) for stage in STAGES]
        next_stage = next((stage for stage, job in zip(STAGES, jobs, strict=True) if job not in done), None)
        if next_stage == "compress":
            self._create({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {
                **owned, "name": names.claim_name(name)}, "spec": {"accessModes": ["ReadWriteMany"], "resources": {
                    "requests": {"storage": spec.storage.size or "1Ti"}}}})
            self._create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**owned, "name": f"{name}-plan"},
                          "data": {"plan.yaml": "{}"}})
            self._service_account(JOB_SERVICE_ACCOUNT)
        if next_stage is not None:
            self._job(body, spec, next_stage, None)
            return
        deployments = []
        for pool in spec.deployment.pools:
            package = names.job_name(name, 1, "package", pool.name)
            if package not in done:
                self._job(body, spec, "package", pool.name)
                continue
            revision = names.revision_name(name, pool.name, 1)
            deployments.append(revision)
            labels = {**names.model_labels(body), names.POOL: pool.name}
            selector = {"matchLabels": labels}
            self._service_account(SERVING_SERVICE_ACCOUNT)
            self._create(egress_policy(body))
            pod = {"metadata": pod_metadata(pool, labels), "spec": {
                **scheduling(pool, node_selector=pool.node_selector), "serviceAccountName": SERVING_SERVICE_ACCOUNT,
                "containers": [{"name": "triton", "image": spec.deployment.triton_image,
                                "resources": {"limits": {model.GPU_RESOURCE: "1"}}}]}}
            revised = {**owned, "name": revision}
            self._create({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": revised,
                          "spec": {"replicas": 1, "selector": selector, "template": pod}})
            self._create({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": revised,
                          "spec": {"minAvailable": 1, "selector": selector}})
            self._create({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": revised,
                          "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": revision},
                                   "minReplicas": 1, "maxReplicas": 2, "metrics": [{"type": "Pods", "pods": {
                                       "metric": {"name": "tailor_queue_size"},
                                       "target": {"type": "AverageValue", "averageValue": "4"}}}]}})
            self._create({"apiVersion": "v1", "kind": "Service", "metadata": {
                **owned, "name": names.service_name(name, pool.name)}, "spec": {
                "selector": labels, "ports": [{"name": "http", "port": 8000}]}})
        if deployments and all(revision in done for revision in deployments):
            self.objects.patch_namespaced_custom_object_status(model.GROUP, model.VERSION, self.namespace,
                                                               model.PLURAL, name, {"status": {"phase": "Ready"}})
            self.ready.add(name)

    def _service_account(self, name: str) -> None:
        """The namespace's ServiceAccount, created once (by the first model that needs it)."""
        self._create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name,
                                                                                 "namespace": self.namespace}})

    def _job(self, body: dict[str, Any], spec: model.CompressedModelSpec, stage: Any, pool: str | None) -> None:
        name = body["metadata"]["name"]
        gpus = spec.jobs.gpus_per_node if stage == "compress" else 1 if stage in STAGES else 0
        settings = JobSettings(image=self.image, gpus_per_node=gpus, nodes=spec.jobs.nodes if stage == "compress"
                               else 1)
        target = next((p for p in spec.deployment.pools if p.name == pool), None) if spec.deployment else None
        placed = (scheduling(target, node_selector=target.node_selector) if target else
                  scheduling(spec.jobs, gpu_terms(CATALOG.get(spec.compression.target_gpu.value))))
        for manifest in stage_job(body, stage, 1, settings, placed, names.claim_name(name), f"{name}-plan",
                                  spec.jobs, pool=pool):
            self._create(manifest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", required=True)
    args = parser.parse_args()
    api = config.new_client_from_config(config_file=args.kubeconfig)
    api.user_agent = "tailor-floor/bench"  # how the benchmark tells its requests in the audit log
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    controller = Floor(api, args.namespace, image="ghcr.io/tailor-dev/tailor-runtime:floor")
    stopping.wait()
    controller.stop()


if __name__ == "__main__":
    main()
