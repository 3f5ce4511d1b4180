"""The batch/v1 Jobs that run a CompressedModel's stages: `tailor compress|quantize|evaluate|package --plan`.

A stage runs the same command as on a workstation, on GPU nodes of the target GPU (by any label that names it:
`placement.gpu_terms`; placed further by `spec.jobs`), with the artifacts claim at /artifacts and its
build plan at /plan. With a Kueue queue, the Job is created suspended and labelled for Kueue, which admits it
(all of its pods at once) when the queue's quota holds them. A multi-node stage is an Indexed Job whose pods
find each other through a headless Service and start torchrun with their completion index as node rank.
Results come back as the container's termination message (`--result-file /dev/termination-log`) and as a file
on the claim.

Pods request CPU and memory as well as GPUs (a pod with only extended resources is BestEffort, the first a
node evicts), and a multi-GPU pod gets a memory-backed /dev/shm (`manifest.shared_memory`).
"""

from __future__ import annotations

import shlex
from typing import Any

from pydantic import BaseModel, Field

from tailor.compressor.buildplan import ARTIFACTS_MOUNT, PLAN_FILE, PLAN_MOUNT, Stage
from tailor.compressor.sizing.hostmemory import HostNeed
from tailor.operator import names
from tailor.operator.api import PodPlacement
from tailor.operator.deployment import NO_EGRESS, PORTS, SPEED_TOKENS_IN_FLIGHT
from tailor.operator.manifest import (
    POD_SECURITY,
    RESTRICTED,
    SCRATCH_ENV,
    SCRATCH_MOUNT,
    SCRATCH_VOLUME,
    as_env,
    container_gpus,
    memory_bounds,
    owned_metadata,
    shared_memory,
)
from tailor.operator.placement import KUEUE_QUEUE_LABEL, pod_metadata, resources

RENDEZVOUS_PORT = 29500
JOB_SERVICE_ACCOUNT = "tailor-job"
RESULT_FILE = "/dev/termination-log"


class JobSettings(BaseModel):
    """Resources and limits of one stage's Job."""

    image: str = Field(min_length=1)
    service_account: str = Field(JOB_SERVICE_ACCOUNT, min_length=1)
    gpus_per_node: int = Field(1, ge=0, le=16)  # 0: a CPU-only step (packaging)
    nodes: int = Field(1, ge=1, le=64)
    backoff_limit: int = Field(2, ge=0, le=100)
    active_deadline_seconds: int = Field(7 * 24 * 3600, ge=60)
    host: HostNeed | None = Field(None, description="The pod's host memory, where its footprint is known; "
                                                   "default: the per-GPU floor request, the allowance as limit.")
    queue_name: str | None = Field(None, description="The Kueue LocalQueue the Job waits in to be admitted.")


def stage_args(stage: Stage, reader: bool = False) -> list[str]:
    """Every stage reads its build plan and writes its result as the termination message (a package's: the
    digests of the code it wrote). A reader hands back a stage's result from the claim."""
    plan = ["--plan", f"{PLAN_MOUNT}/{PLAN_FILE}"]
    if reader:
        return ["result", *plan, "--stage", stage, "--result-file", RESULT_FILE]
    ports = [f"--{name}-port={PORTS[name]}" for name in ("http", "grpc")] if stage == "speed" else []
    return [stage, *plan, *ports, "--result-file", RESULT_FILE]


def launcher(name: str, settings: JobSettings, args: list[str]) -> list[str]:
    """The container command: tailor itself, or torchrun around it for more than one GPU or node."""
    module = ["-m", "tailor.cli.main", *args]
    if settings.nodes > 1:
        torchrun = ["torchrun", "--nnodes", str(settings.nodes), "--nproc-per-node", str(settings.gpus_per_node),
                    "--master-addr", f"{name}-0.{name}", "--master-port", str(RENDEZVOUS_PORT)]
        # the rank comes from the pod's environment, so a shell expands it; everything else is quoted
        return ["sh", "-c", f"exec {shlex.join(torchrun)} --node-rank \"$JOB_COMPLETION_INDEX\" "
                            f"{shlex.join(module)}"]
    if settings.gpus_per_node > 1:
        return ["torchrun", "--standalone", f"--nproc-per-node={settings.gpus_per_node}", *module]
    return ["tailor", *args]


DOWNLOADS: Stage = "compress"  # a build's first stage fetches an hf:// parent into the cache, with the token


def downloads(stage: Stage, reader: bool) -> bool:
    """Whether the Job of `stage` (its result `reader`'s, if so) may reach the hub. The others (and the speed Job,
    which serves) read the parent from the cache offline, with no egress at all (`deployment.egress_policy`)."""
    return stage == DOWNLOADS and not reader


def stage_job(model: dict[str, Any], stage: Stage, generation: int, settings: JobSettings,
              scheduling: dict[str, Any], claim: str, plan_config_map: str, placement: PodPlacement | None = None,
              claims: dict[str, str] | None = None, pool: str | None = None, env: list[dict[str, Any]] | None = None,
              reader: bool = False, sidecar: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The Job (and, for several nodes, its headless Service) running `tailor <stage> --plan` for the
    generation `generation`; `claims` are mounted read-only, by mount path (a pvc:// source's at /source, the
    data's at /data). `scheduling` (`placement.scheduling`) places the pods; `placement` (spec.jobs) gives them
    labels and annotations, and a stage with GPUs its resources.
    A `reader` Job hands back the stage's result from the claim (`tailor result`). A `sidecar` (the speed Job's
    Triton) runs beside the stage as a native sidecar, in the pod's process namespace, and is stopped when the
    stage ends."""
    name = names.job_name(model["metadata"]["name"], generation, stage, pool)
    if reader:
        name = names.reader_name(name)
    labels = {**names.model_labels(model), names.STAGE: stage, names.GENERATION: str(generation)}
    meta = owned_metadata(model, name, labels)
    gpus = settings.gpus_per_node
    mounts = [{"name": "artifacts", "mountPath": ARTIFACTS_MOUNT},
              {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "artifacts", "persistentVolumeClaim": {"claimName": claim}},
                                     {"name": "plan", "configMap": {"name": plan_config_map}}, SCRATCH_VOLUME]
    mounts.append(SCRATCH_MOUNT)
    for mount_path, claim_name in (claims or {}).items():
        volume = mount_path.strip("/")
        mounts.append({"name": volume, "mountPath": mount_path, "readOnly": True})
        volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim_name, "readOnly": True}})
    shm_mounts, shm_volumes = shared_memory(gpus)
    mounts += shm_mounts
    volumes += shm_volumes
    requests, limits = memory_bounds(settings.host, gpus)
    container_resources = resources(requests, gpus, placement if gpus else None, "spec.jobs.resources", limits)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": settings.service_account,
        "automountServiceAccountToken": False,  # the stages never call the Kubernetes API
        "securityContext": POD_SECURITY,
        "containers": [{
            "name": stage, "image": settings.image, "command": launcher(name, settings, stage_args(stage, reader)),
            "env": [*(env or []), *as_env(SCRATCH_ENV)],
            "resources": container_resources,
            "volumeMounts": mounts,
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": RESTRICTED,
        }],
        "volumes": volumes,
    }
    if sidecar is not None:
        sidecar = {**sidecar, "restartPolicy": "Always"}
        # its Python backend, and its tensor-parallel workers, exchange through shared memory
        shm_mounts, shm_volumes = shared_memory(container_gpus(sidecar), SPEED_TOKENS_IN_FLIGHT)
        sidecar["volumeMounts"] = [*sidecar["volumeMounts"], *shm_mounts]
        volumes += shm_volumes
        pod_spec["initContainers"] = [sidecar]
        pod_spec["shareProcessNamespace"] = True
    pod_spec.update(scheduling)
    pod_labels = labels if downloads(stage, reader) else {**labels, **NO_EGRESS}
    pod: dict[str, Any] = {"metadata": pod_metadata(placement, pod_labels), "spec": pod_spec}
    spec: dict[str, Any] = {"backoffLimit": settings.backoff_limit,
                            "activeDeadlineSeconds": settings.active_deadline_seconds, "template": pod}
    job_meta = meta
    if settings.queue_name is not None:  # Kueue unsuspends it once admitted
        job_meta = {**meta, "labels": {**labels, KUEUE_QUEUE_LABEL: settings.queue_name}}
        spec["suspend"] = True
    objects: list[dict[str, Any]] = []
    if settings.nodes > 1:  # one pod per node, all of its GPUs: the ranks find each other by DNS
        pod_spec["subdomain"] = name
        pod_spec["affinity"] = {**pod_spec.get("affinity", {}), "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}]}}
        spec.update(completionMode="Indexed", completions=settings.nodes, parallelism=settings.nodes)
        objects.append({"apiVersion": "v1", "kind": "Service", "metadata": meta,
                        "spec": {"clusterIP": "None", "selector": labels,
                                 "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}]}})
    objects.insert(0, {"apiVersion": "batch/v1", "kind": "Job", "metadata": job_meta, "spec": spec})
    return objects
