"""The floor for `bench/operator.py`: a minimal controller that makes each CompressedModel Ready with only the
writes Tailor must do, and nothing Tailor decides in between (no observation of what it created, pre-flight checks,
result parsing, status history, events).

The writes are Tailor's own manifests, made by Tailor's own functions on a pass that sees nothing but the model
(`Pass` over an `Observed` with no objects): the artifacts claim, the stage ServiceAccount, the plan ConfigMap and
each stage's Job (`workloads.start_job`, the plan from `resolve.resolve`); per pool the package plan ConfigMap and
Job (`rollout.package`), then the revision (`rollout.create_revision`: the serving ServiceAccount, the no-egress
NetworkPolicy, the Deployment with its PodDisruptionBudget and autoscaler, the Service); then the status patch
`phase: Ready` and, as Tailor does in that pass, the speed Job (`speedup.start`). Pools are sized once per model
(`pools.plan_pool`) on the nodes as listed when the first model came, for the child in the results kwok hands
back (the model's `devcluster.tailor.dev/result-*` pod annotations). Events come from three watches (models,
Jobs, Deployments) and wake the model's step on a pool of worker threads, as kopf's daemons do for the operator.
It runs as a process of its own, as the operator does, until SIGTERM:

    python bench/floor.py --kubeconfig FILE --namespace bench
"""

from __future__ import annotations

import argparse
import json
import queue
import signal
import threading
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from tailor.compressor.buildplan import BuildPlan
from tailor.compressor.results import CompressResult, QuantizeResult
from tailor.devcluster.simulated import RESULT_ANNOTATION
from tailor.operator import api as model
from tailor.operator import names, rollout, speedup
from tailor.operator.decision import Create, Pass
from tailor.operator.observe import Observed
from tailor.operator.placement import gpu_terms, scheduling
from tailor.operator.pools import NodeSnapshot, PoolPlan, plan_pool
from tailor.operator.resolve import fingerprint, resolve, target_batch
from tailor.operator.settings import OperatorSettings
from tailor.operator.workloads import claim_ready, start_job

WORKERS = 8
SETTINGS = OperatorSettings()  # the operator's defaults: its image, ServiceAccounts and GPU catalog
GENERATION = 1


class Floor:
    """Runs until `stop()`; `api` is the devcluster's admin client, `namespace` the benchmark's."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self.core, self.batch, self.apps = client.CoreV1Api(api), client.BatchV1Api(api), client.AppsV1Api(api)
        self.objects = client.CustomObjectsApi(api)
        self.networking, self.policy = client.NetworkingV1Api(api), client.PolicyV1Api(api)
        self.autoscaling = client.AutoscalingV2Api(api)
        self.models: dict[str, dict[str, Any]] = {}
        self.done: dict[str, set[str]] = {}  # model -> finished Jobs and available Deployments
        self.ready: set[str] = set()
        self.created: set[tuple[str, str]] = set()  # (kind, name) of every object created
        self.plans: dict[str, tuple[BuildPlan, dict[str, PoolPlan]]] = {}  # model -> its plan and pool sizings
        self.nodes: NodeSnapshot | None = None
        self.lock = threading.Lock()
        self.work: queue.Queue[str | None] = queue.Queue()
        self.watches: list[watch.Watch] = []
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(WORKERS)]
        self.threads += [threading.Thread(target=self._watch, args=watched, daemon=True) for watched in (
            (self._on_model, self.objects.list_namespaced_custom_object, model.GROUP, model.API_VERSION, namespace,
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
        plan, sized = self._planned(body, spec)
        p = self._pass(body, spec, plan)
        stage = next((s for s in plan.stages if names.job_name(name, GENERATION, s) not in done), None)
        if stage is not None:
            claim_ready(p, spec)
            start_job(p, spec, plan, stage, GENERATION, names.plan_name(name, GENERATION),
                      scheduling(spec.jobs, gpu_terms(plan.catalog().get(plan.target_gpu))))
            self._send(p)
            return
        revisions = [names.revision_name(name, pool.name, GENERATION) for pool in spec.deployment.pools]
        for pool in spec.deployment.pools:
            if names.job_name(name, GENERATION, "package", pool.name) not in done:
                rollout.package(p, spec, plan, sized[pool.name])
            else:
                rollout.create_revision(p, spec, plan, sized[pool.name], first=True)
        self._send(p)
        if all(revision in done for revision in revisions):
            self.objects.patch_namespaced_custom_object_status(model.GROUP, model.API_VERSION, self.namespace,
                                                               model.PLURAL, name, {"status": {"phase": "Ready"}})
            self.ready.add(name)
            measured = speedup.measured_pool(spec)
            if measured is not None:
                p = self._pass(body, spec, plan)
                speedup.start(p, spec, plan, model.PoolStatus(name=measured,
                                                              gpus_per_replica=sized[measured].tensor_parallel))
                self._send(p)

    def _planned(self, body: dict[str, Any], spec: model.CompressedModelSpec
                 ) -> tuple[BuildPlan, dict[str, PoolPlan]]:
        """The model's build plan and its pools' sizings, worked out once, as Tailor's operator does."""
        name = body["metadata"]["name"]
        with self.lock:
            found = self.plans.get(name)
        if found is None:
            assert spec.deployment is not None
            nodes = self._nodes()
            plan = resolve(spec, body, GENERATION, SETTINGS.catalog,
                           target_batch(spec, nodes, SETTINGS.catalog).value)
            built = rollout.read_built(*child(spec, plan))
            found = plan, {pool.name: plan_pool(pool, nodes, built, spec.deployment, SETTINGS.catalog)
                           for pool in spec.deployment.pools}
            with self.lock:
                self.plans[name] = found
        return found

    def _nodes(self) -> NodeSnapshot:
        """The cluster's nodes, listed once (when the first model comes)."""
        with self.lock:
            if self.nodes is None:
                reply = self.core.list_node(_preload_content=False)
                self.nodes = NodeSnapshot(json.loads(reply.data)["items"])
            return self.nodes

    def _pass(self, body: dict[str, Any], spec: model.CompressedModelSpec, plan: BuildPlan) -> Pass:
        """A pass that sees only the model, its build recorded as Tailor records it: what Tailor's functions
        create on it is what Tailor creates."""
        config_text, recipe, kv = child(spec, plan)
        status = model.CompressedModelStatus(build=model.BuildStatus(
            generation=GENERATION, fingerprint=fingerprint(spec), child_config=config_text, recipe=recipe,
            kv_cache_dtype=kv))
        return Pass(Observed(model=body), SETTINGS, status)

    def _send(self, p: Pass) -> None:
        for action in p.actions:
            assert isinstance(action, Create)
            self._create(action.manifest)


def child(spec: model.CompressedModelSpec, plan: BuildPlan) -> tuple[str, str, str]:
    """The child's packed config, its recipe and KV-cache dtype, from the results kwok hands back (the stage
    pods' annotations), as Tailor records them."""
    annotations = spec.jobs.pod_annotations
    compress = CompressResult.model_validate_json(annotations[RESULT_ANNOTATION.format(stage="compress")])
    quantize = QuantizeResult.model_validate_json(annotations[RESULT_ANNOTATION.format(stage="quantize")])
    return compress.config, quantize.recipe, plan.kv_cache_dtype.value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", required=True)
    args = parser.parse_args()
    api = config.new_client_from_config(config_file=args.kubeconfig)
    api.user_agent = "tailor-floor/bench"  # how the benchmark tells its requests in the audit log
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    controller = Floor(api, args.namespace)
    stopping.wait()
    controller.stop()


if __name__ == "__main__":
    main()
