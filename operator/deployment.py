"""The Kubernetes objects that serve a CompressedModel on one node pool: a Triton Deployment sized by its
`PoolPlan`, a Service, a PodDisruptionBudget and a HorizontalPodAutoscaler on the engine's queue metrics.

The pool's engine decides the image: vLLM pools run `deployment.tritonImage` (NVIDIA's Triton vLLM image, for its
vLLM and Triton's Python backend), which runs the backend the package Job put in the model repository (tailor's,
`model.py`: the code the devcluster's pods run) with the engine arguments beside it (`model.json`: max_num_seqs,
max_model_len, KV-cache bytes and dtype, tensor parallelism, from the sizing); the Python fallback engine runs
tailor's runtime image. Triton pods never reach a model hub (`OFFLINE_ENV`): they load only the claim's files, and
a NetworkPolicy denies them every egress (`egress_policy`); another lets only their namespace, the monitoring stack
and the clients the operator was told of reach them (`ingress_policy`).

Each generation that deploys gets its own revision (`<model>-<pool>-g<generation>`: Deployment, PDB, HPA);
the pool's Service (`<model>-<pool>`) selects one revision, and moves to a new one only once it is ready.
Plain manifests (dicts), each owned by the CompressedModel so they go when it goes. The model repository is
read from the artifacts claim; the startup probe allows for loading the weights at a conservative 200 MB/s and
the engine's warm-up, or the pool's startupSeconds. Triton's crash leaves its last log lines as its termination
message, which the operator keeps when a revision fails.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tailor.compressor.buildplan import MODELS_MOUNT, repository_in_pod
from tailor.compressor.serving import codecheck
from tailor.compressor.sizing.engines import Engine
from tailor.compressor.sizing.hardware import GpuProfile
from tailor.compressor.sizing.hostmemory import HostNeed
from tailor.operator import names
from tailor.operator.api import GROUP, DeploymentSpec, NodePoolTarget
from tailor.operator.manifest import (
    POD_SECURITY,
    RESTRICTED,
    SCRATCH_ENV,
    SCRATCH_MOUNT,
    SCRATCH_VOLUME,
    as_env,
    decimal_quantity,
    memory_bounds,
    owned_metadata,
    shared_memory,
)
from tailor.operator.placement import gpu_terms, pod_metadata, resources, scheduling
from tailor.operator.pools import PoolPlan

PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
OPENAI_PORT = 9000  # vLLM pools: the OpenAI-compatible API (`tailor openai`), a container beside Triton
OPENAI_REQUESTS = {"cpu": "250m", "memory": "1Gi"}  # a proxy that tokenizes prompts: no GPU
LOAD_BYTES_PER_SECOND = 200e6  # slow network storage; a startup probe must not kill a replica still loading
# After its weights are in, an engine starts serving: vLLM profiles memory, compiles (torch.compile) and captures
# CUDA graphs, minutes for a large model; the Python fallback engine only starts Triton.
WARMUP_S = {Engine.VLLM: 600, Engine.PYTHON: 120}
PROBE_PERIOD_S = 10
PROBE_TIMEOUT_S = 5  # a server busy streaming answers its health endpoint late; a late answer is not a failure
PROGRESS_MARGIN_S = 300  # scheduling and a cold pull of the engine's image, beyond the startup allowance
SERVING_SERVICE_ACCOUNT = "tailor-serving"
ENGINE_ANNOTATION = "tailor.dev/engine"
ENGINE_ARGS_ANNOTATION = "tailor.dev/engine-args"  # vLLM's model.json, as the package Job writes it
# Metrics a prometheus-adapter serves per pod from Triton's /metrics (rules in the Helm chart's
# prometheus-adapter-values.yaml), by engine: vLLM's own (`vllm:*` on Triton's metrics port) and, for the
# Python fallback engine, Triton's queue metrics. The fallback has no KV-cache metric: it scales on waiting
# requests instead.
POD_METRICS = {
    Engine.VLLM: {"requestsWaiting": "vllm_requests_waiting", "kvCacheUsage": "vllm_kv_cache_usage",
                  "queueTimeSeconds": "vllm_queue_time_seconds"},
    Engine.PYTHON: {"requestsWaiting": "triton_requests_waiting", "kvCacheUsage": "triton_requests_waiting",
                    "queueTimeSeconds": "triton_queue_time_seconds"},
}
# Derived HPA targets (docs/how-to/autoscaling.md): scale out once the requests waiting per replica pass this share of
# what a replica runs at once (max_num_seqs), before a queue as long as a whole batch builds up.
WAITING_SHARE_OF_BATCH = 0.25
DEFAULT_TARGETS = {"kvCacheUsage": 0.8, "queueTimeSeconds": 2.0}
SCALE_DOWN_PODS_PER_MINUTE = 1  # one replica at a time, each drained first
# On a real cluster a Service stops sending to a terminating pod only once every kube-proxy has seen its endpoint
# go: the pod keeps taking requests this long before Triton is told to stop.
ENDPOINT_PROPAGATION_S = 5
# No hub, no telemetry: the pod runs only the files the build wrote to the claim, and calls no one
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}

SPEED_TOKENS_IN_FLIGHT = 16 * 128  # the speed Job's requests: 16 at once, a short prompt and 64 new tokens each
TRITON = {names.APP_NAME: "triton"}
NO_EGRESS = {f"{GROUP}/egress": "none"}  # the pods `egress_policy` cuts off: Triton's and the speed Job's
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # every namespace has it, set by the API server


def labels(model: dict[str, Any], pool: str) -> dict[str, str]:
    return {**TRITON, **names.model_labels(model), names.POOL: pool}


def revision_labels(model: dict[str, Any], pool: str, generation: int) -> dict[str, str]:
    return {**labels(model, pool), names.REVISION: names.revision_of(generation)}


def egress_policy(model: dict[str, Any]) -> dict[str, Any]:
    """No egress at all from the model's pods but the compression Job's (which downloads the parent): the later
    stages, Triton and its OpenAI API, the speed Job. They load only the claim's files and answer on their own
    ports, so a checkpoint's code could reach no hub and send nothing out.
    Ingress (clients, Prometheus) is left alone. Enforced where the network plugin enforces NetworkPolicy (GKE
    Dataplane V2, the EKS VPC CNI with network policies on, Calico, Cilium); elsewhere HF_HUB_OFFLINE remains."""
    selector = {**names.model_labels(model), **NO_EGRESS}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": owned_metadata(model, names.egress_policy_name(model["metadata"]["name"]),
                                  names.model_labels(model)),
            "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Egress"], "egress": []}}


@dataclass(frozen=True)
class ServingIngress:
    """Who may reach a model's serving pods besides its own namespace: the monitoring stack's namespaces
    (Prometheus scrapes the metrics port) and clients elsewhere (a gateway's namespace, a load balancer's range)."""

    monitoring_namespaces: tuple[str, ...] = ("monitoring",)
    client_namespaces: tuple[str, ...] = ()
    client_cidrs: tuple[str, ...] = ()


def ingress_policy(model: dict[str, Any], allowed: ServingIngress) -> dict[str, Any]:
    """Ingress to the model's serving pods only from pods of its namespace and from `allowed`: another tenant's
    pods cannot call its models or read their metrics. Enforced where the network plugin enforces NetworkPolicy
    (as `egress_policy`); kubelet probes come from the node, which those plugins let through."""
    peers: list[dict[str, Any]] = [{"podSelector": {}}]
    namespaces = sorted({*allowed.monitoring_namespaces, *allowed.client_namespaces})
    if namespaces:
        peers.append({"namespaceSelector": {"matchExpressions": [
            {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": namespaces}]}})
    peers += [{"ipBlock": {"cidr": cidr}} for cidr in allowed.client_cidrs]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": owned_metadata(model, names.ingress_policy_name(model["metadata"]["name"]),
                                  names.model_labels(model)),
            "spec": {"podSelector": {"matchLabels": {**names.model_labels(model), **NO_EGRESS}},
                     "policyTypes": ["Ingress"], "ingress": [{"from": peers}]}}


def pod_ports(engine: Engine) -> dict[str, int]:
    """The ports a pool's pods serve: Triton's, and the OpenAI-compatible API's on vLLM pools."""
    return {**PORTS, "openai": OPENAI_PORT} if engine is Engine.VLLM else dict(PORTS)


def service(model: dict[str, Any], pool: str, generation: int, engine: Engine) -> dict[str, Any]:
    """The pool's stable Service, pointing at one revision."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": owned_metadata(model, names.service_name(model["metadata"]["name"], pool),
                                       labels(model, pool)),
            "spec": {"selector": revision_labels(model, pool, generation),
                     "ports": [{"name": name, "port": port, "targetPort": name}
                               for name, port in pod_ports(engine).items()]}}


def hpa_target(plan: PoolPlan, deployment: DeploymentSpec) -> float:
    """The average per replica the HPA holds the pool's metric to: the spec's, or derived from the sizing for the
    series the pool's engine reports under that name (the Python engine's KV-cache name is its waiting count)."""
    autoscaling = deployment.autoscaling
    if autoscaling.target is not None:
        return autoscaling.target
    metric = autoscaling.metric
    if plan.engine is Engine.PYTHON and metric == "kvCacheUsage":
        metric = "requestsWaiting"
    if metric == "requestsWaiting":
        return max(1, math.ceil(WAITING_SHARE_OF_BATCH * plan.max_num_seqs()))
    return DEFAULT_TARGETS[metric]


def autoscaler(plan: PoolPlan, deployment: DeploymentSpec) -> dict[str, Any]:
    """The HorizontalPodAutoscaler's spec, less its scale target: the spec's metric and target (plus KV-cache
    usage on vLLM pools that scale on something else), stabilisation windows, one replica removed a minute."""
    assert plan.engine is not None
    autoscaling = deployment.autoscaling
    targets = {autoscaling.metric: hpa_target(plan, deployment)}
    if plan.engine is Engine.VLLM and autoscaling.metric != "kvCacheUsage":
        targets["kvCacheUsage"] = autoscaling.kv_cache_target
    return {
        "minReplicas": deployment.min_replicas, "maxReplicas": deployment.max_replicas,
        "metrics": [{"type": "Pods", "pods": {"metric": {"name": POD_METRICS[plan.engine][metric]},
                                              "target": {"type": "AverageValue",
                                                         "averageValue": decimal_quantity(value)}}}
                    for metric, value in targets.items()],
        "behavior": {
            "scaleUp": {"stabilizationWindowSeconds": autoscaling.scale_up_stabilization_seconds},
            "scaleDown": {"stabilizationWindowSeconds": autoscaling.scale_down_stabilization_seconds,
                          "selectPolicy": "Min",
                          "policies": [{"type": "Pods", "value": SCALE_DOWN_PODS_PER_MINUTE, "periodSeconds": 60}]}},
    }


def startup_seconds(plan: PoolPlan, pool: NodePoolTarget) -> int:
    """How long a replica may take from its start to ready: the pool's startupSeconds, else loading a replica's
    weights at `LOAD_BYTES_PER_SECOND` plus the engine's warm-up."""
    if pool.startup_seconds is not None:
        return pool.startup_seconds
    assert plan.sizing is not None and plan.tensor_parallel is not None and plan.engine is not None
    return math.ceil(plan.sizing.footprint.weights * plan.tensor_parallel / LOAD_BYTES_PER_SECOND
                     + WARMUP_S[plan.engine])


def lifecycle() -> dict[str, Any]:
    """Out of the Service's endpoints before SIGTERM. An exec hook, not the sleep action: that needs Kubernetes
    1.30, the chart supports 1.29."""
    return {"preStop": {"exec": {"command": ["sleep", str(ENDPOINT_PROPAGATION_S)]}}}


def probe(path: str, port: str = "http", failures: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": PROBE_TIMEOUT_S, "failureThreshold": failures}


def serving_env() -> list[dict[str, str]]:
    """No hub, no telemetry, and the scratch folder's HOME and caches (`manifest.SCRATCH`)."""
    return as_env({**OFFLINE_ENV, **SCRATCH_ENV})


def triton_container(repository: str, image: str, resources: dict[str, Any], mounts: list[dict[str, Any]],
                     code: Mapping[str, str] | None, *args: str) -> dict[str, Any]:
    """Triton serving `repository` on `PORTS` (and `args`), ready once its models are: a pool's replica and the
    speed Job's sidecar each add to it. It first checks the repository's code against the digests its package Job
    handed back (`code`, paths under the claim's root; `codecheck`), unless there are none (a simulated package)."""
    server = ["tritonserver", f"--model-repository={repository}",
              *(f"--{name}-port={port}" for name, port in PORTS.items()), *args]
    env = serving_env()
    command, arguments = server[:1], server[1:]
    if code is not None:
        command, arguments, lines = codecheck.checked(MODELS_MOUNT, code, server)
        env.append({"name": codecheck.CODE_ENV, "value": lines})
    return {
        "name": "triton", "image": image, "command": command, "args": arguments,
        "ports": [{"name": name, "containerPort": port} for name, port in PORTS.items()],
        "env": env,
        "resources": resources,
        "volumeMounts": [*mounts, SCRATCH_MOUNT],
        "readinessProbe": probe("/v2/health/ready"),
        "securityContext": RESTRICTED,
    }


def openai_container(repository: str, image: str, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """The OpenAI-compatible API beside Triton (`tailor openai`, from `image`, tailor's runtime image): it reads
    the model names and tokenizers from the repository and sends each request to Triton on the pod's loopback.
    Ready once Triton is."""
    return {
        "name": "openai", "image": image, "command": ["tailor", "openai"],
        "args": [f"--model-repository={repository}", f"--triton-port={PORTS['http']}",
                 f"--openai-port={OPENAI_PORT}"],
        "ports": [{"name": "openai", "containerPort": OPENAI_PORT}],
        "env": serving_env(),
        "resources": {"requests": dict(OPENAI_REQUESTS), "limits": {"memory": OPENAI_REQUESTS["memory"]}},
        "volumeMounts": [*mounts, SCRATCH_MOUNT],
        "readinessProbe": probe("/health", "openai"),
        "lifecycle": lifecycle(),
        "securityContext": RESTRICTED,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def gpu_resources(gpus: int, pool: NodePoolTarget, host: HostNeed | None, tokens_in_flight: int) -> dict[str, Any]:
    """Triton's requests and limits: `gpus` GPUs, memory for `host` and its /dev/shm (`manifest.memory_bounds`),
    the pool's own requests and limits over them."""
    requests, limits = memory_bounds(host, gpus, tokens_in_flight)
    return resources(requests, gpus, pool, f"spec.deployment.pools[{pool.name}].resources", limits)


def speed_sidecar(image: str, repository: str, gpus: int, pool: NodePoolTarget,
                  code: Mapping[str, str] | None) -> dict[str, Any]:
    """Triton on the parent and child packaged side by side, beside `tailor speed` in the speed Job's pod (which
    mounts the artifacts claim as the volume `artifacts`): the pool's image and resources, `gpus` GPUs, loopback
    clients only."""
    # the parent's replica and the child's: an allowance; its requests are short (`SPEED_TOKENS_IN_FLIGHT`)
    return triton_container(repository, image, gpu_resources(gpus, pool, None, SPEED_TOKENS_IN_FLIGHT),
                            [{"name": "artifacts", "mountPath": MODELS_MOUNT, "readOnly": True}], code)


def manifests(model: dict[str, Any], plan: PoolPlan, deployment: DeploymentSpec, claim: str,
              package: str, generation: int, image: str, code: Mapping[str, str] | None,
              engine_config: dict[str, Any] | None = None,
              service_account: str = SERVING_SERVICE_ACCOUNT, frontend_image: str | None = None
              ) -> list[dict[str, Any]]:
    """A pool's revision for `generation`: Deployment, PodDisruptionBudget and HorizontalPodAutoscaler, for a
    pool that is not skipped. `package` is the pool's `tailor package` folder inside `claim`, whose `code`
    Triton checks before it starts (`triton_container`); the pods run as
    `service_account` with no API token (Triton never calls the Kubernetes API). The Deployment's progress
    deadline is the startup allowance plus five minutes: past it the revision is failed, not waited for. The
    engine and, for vLLM, the engine arguments the package Job writes (`engine_config`) are annotations, so that
    `kubectl get deploy -o yaml` shows what each replica runs with. vLLM pods also serve the OpenAI-compatible
    API from `frontend_image` (`openai_container`)."""
    if (plan.skipped is not None or plan.sizing is None or plan.replicas is None or plan.tensor_parallel is None
            or plan.engine is None):
        raise ValueError(f"pool {plan.name} is skipped: {plan.skipped}")
    selector = revision_labels(model, plan.name, generation)
    target = pool_target(deployment, plan.name)
    meta = owned_metadata(model, names.revision_name(model["metadata"]["name"], plan.name, generation), selector)

    gpus = plan.tensor_parallel
    startup = math.ceil(startup_seconds(plan, target) / PROBE_PERIOD_S)
    # the requests a replica holds at once, each up to the context: what its Python backend hands through /dev/shm
    tokens = plan.sizing.concurrency_per_replica * deployment.context_length
    shm_mounts, shm_volumes = shared_memory(gpus, tokens)  # and tensor-parallel workers exchange through it
    mounts: list[dict[str, Any]] = [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}, *shm_mounts]
    volumes: list[dict[str, Any]] = [
        {"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}, *shm_volumes,
        SCRATCH_VOLUME]
    container = {
        # on SIGTERM Triton refuses new requests and finishes those it holds, for up to the drain time
        **triton_container(repository_in_pod(package), image, gpu_resources(gpus, target, plan.host, tokens),
                           mounts, code, f"--exit-timeout-secs={deployment.drain_seconds}"),
        "startupProbe": probe("/v2/health/ready", failures=startup),
        "livenessProbe": probe("/v2/health/live"),
        "lifecycle": lifecycle(),
        "terminationMessagePolicy": "FallbackToLogsOnError",  # a crash's last log lines, for the operator to keep
    }
    placed = pool_scheduling(target, plan.node_selector)
    pod = {
        "metadata": pod_metadata(target, {**selector, **NO_EGRESS}, {"prometheus.io/scrape": "true",
                                                                      "prometheus.io/port": str(PORTS["metrics"])}),
        "spec": {
            "serviceAccountName": service_account,
            "automountServiceAccountToken": False,
            **placed,
            "affinity": {**placed.get("affinity", {}), "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [{
                    "weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": selector},
                                                       "topologyKey": "kubernetes.io/hostname"}}]}},
            "securityContext": POD_SECURITY,
            "terminationGracePeriodSeconds": ENDPOINT_PROPAGATION_S + deployment.drain_seconds + PROBE_PERIOD_S,
            "containers": [container] + ([openai_container(repository_in_pod(package), frontend_image, mounts)]
                                         if plan.engine is Engine.VLLM and frontend_image is not None else []),
            "volumes": volumes,
        },
    }
    described = {**meta, "annotations": {ENGINE_ANNOTATION: plan.engine.value}}
    if engine_config is not None:
        described["annotations"][ENGINE_ARGS_ANNOTATION] = json.dumps(engine_config, sort_keys=True)
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": described,
         "spec": {"replicas": plan.replicas, "selector": {"matchLabels": selector}, "template": pod,
                  "progressDeadlineSeconds": startup * PROBE_PERIOD_S + PROGRESS_MARGIN_S,
                  "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta,
         # voluntary disruptions (node drains) keep minReplicas ready, also while the HPA drains a replica away;
         # a replica that is not ready never blocks a drain
         "spec": {"minAvailable": deployment.min_replicas, "selector": {"matchLabels": selector},
                  "unhealthyPodEvictionPolicy": "AlwaysAllow"}},
        {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta,
         "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"]},
                  **autoscaler(plan, deployment)}},
    ]


def pool_target(deployment: DeploymentSpec, pool: str) -> NodePoolTarget:
    return next(target for target in deployment.pools if target.name == pool)


def pool_scheduling(pool: NodePoolTarget, node_selector: dict[str, str], gpu: GpuProfile | None = None
                    ) -> dict[str, Any]:
    """Where the pool's Triton pods, package Job and speed Job run: on the nodes `node_selector` selects (the pool's,
    as its plan found them: `PoolPlan.node_selector`), with the pool's tolerations, node affinity and priority
    class. A pod that asks for no GPU (the package Job's) is kept to the nodes with the pool's `gpu` as well: the
    selector alone may match nodes outside the pool (a CPU node carrying the same label)."""
    return scheduling(pool, gpu_terms(gpu) if gpu else None, node_selector=node_selector)
