"""The floor for `bench/operator.py`: a minimal controller that makes each CompressedModel Ready with only the
writes Tailor must do, and nothing Tailor decides in between (no plan resolution, sizing, pre-flight checks, result
parsing, status history, events).

Per model, as each step's object finishes: the artifacts claim, the plan ConfigMap and the compress Job; then the
quantize and evaluate Jobs; then per pool a package Job, then a one-replica Deployment with its Service; then the
status patch `phase: Ready`. The Jobs are Tailor's own manifests (`jobs.stage_job`, with the model's pod
annotations: kwok finishes them as it finishes Tailor's). Events come from two watches (Jobs, Deployments) and wake
the model's step on a pool of worker threads, as kopf's daemons do for the operator.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tailor.compressor.hardware import GpuCatalog
from tailor.operator import api as model
from tailor.operator import names
from tailor.operator.jobs import JobSettings, gpu_terms, stage_job
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
        self.models: dict[str, dict[str, Any]] = {}
        self.done: dict[str, set[str]] = {}  # model -> finished Jobs and available Deployments
        self.ready: set[str] = set()
        self.lock = threading.Lock()
        self.work: queue.Queue[str | None] = queue.Queue()
        self.watches: list[watch.Watch] = []
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(WORKERS)]
        self.threads += [threading.Thread(target=target, daemon=True)
                         for target in (self._watch_models, self._watch_jobs, self._watch_deployments)]
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        for stream in self.watches:
            stream.stop()
        for _ in range(WORKERS):
            self.work.put(None)

    # --- events -----------------------------------------------------------------------------------

    def _stream(self, lister: Any, *args: Any) -> Any:
        stream = watch.Watch()
        self.watches.append(stream)
        return stream.stream(lister, *args, timeout_seconds=3600)

    def _watch_models(self) -> None:
        for event in self._stream(self.objects.list_namespaced_custom_object, model.GROUP, model.VERSION,
                                  self.namespace, model.PLURAL):
            body = event["object"]
            name = body["metadata"]["name"]
            with self.lock:
                if event["type"] == "ADDED" and name not in self.models:
                    self.models[name], self.done[name] = body, set()
                    self.work.put(name)

    def _owner(self, labels: dict[str, str] | None) -> str | None:
        return (labels or {}).get(names.MODEL)

    def _watch_jobs(self) -> None:
        for event in self._stream(self.batch.list_namespaced_job, self.namespace):
            job = event["object"]
            owner = self._owner(job.metadata.labels)
            if owner is not None and any(c.type == "Complete" and c.status == "True"
                                         for c in (job.status.conditions or [])):
                self._finished(owner, job.metadata.name)

    def _watch_deployments(self) -> None:
        for event in self._stream(self.apps.list_namespaced_deployment, self.namespace):
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
        try:
            client_for = {"Job": self.batch.create_namespaced_job, "ConfigMap": self.core.create_namespaced_config_map,
                          "PersistentVolumeClaim": self.core.create_namespaced_persistent_volume_claim,
                          "Deployment": self.apps.create_namespaced_deployment,
                          "Service": self.core.create_namespaced_service}[manifest["kind"]]
            client_for(self.namespace, manifest)
        except ApiException as error:
            if error.status != 409:  # a step woken twice creates once
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
            pod = {"metadata": pod_metadata(pool, labels), "spec": {
                **scheduling(pool, node_selector=pool.node_selector),
                "containers": [{"name": "triton", "image": spec.deployment.triton_image,
                                "resources": {"limits": {model.GPU_RESOURCE: "1"}}}]}}
            self._create({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**owned, "name": revision},
                          "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": pod}})
            self._create({"apiVersion": "v1", "kind": "Service", "metadata": {
                **owned, "name": names.service_name(name, pool.name)}, "spec": {
                "selector": labels, "ports": [{"name": "http", "port": 8000}]}})
        if deployments and all(revision in done for revision in deployments):
            self.objects.patch_namespaced_custom_object_status(model.GROUP, model.VERSION, self.namespace,
                                                               model.PLURAL, name, {"status": {"phase": "Ready"}})
            self.ready.add(name)

    def _job(self, body: dict[str, Any], spec: model.CompressedModelSpec, stage: Any, pool: str | None) -> None:
        name = body["metadata"]["name"]
        gpus = spec.jobs.gpus_per_node if stage == "compress" else 1 if stage in STAGES else 0
        settings = JobSettings(image=self.image, gpus_per_node=gpus, nodes=1)
        target = next((p for p in spec.deployment.pools if p.name == pool), None) if spec.deployment else None
        placed = (scheduling(target, node_selector=target.node_selector) if target else
                  scheduling(spec.jobs, gpu_terms(CATALOG.get(spec.compression.target_gpu.value))))
        for manifest in stage_job(body, stage, 1, settings, placed, names.claim_name(name), f"{name}-plan",
                                  spec.jobs, pool=pool):
            self._create(manifest)
