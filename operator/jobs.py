"""The batch/v1 Jobs that run a CompressedModel's stages: `tailor compress`, `tailor quantize`, `tailor evaluate`.

A stage runs the same command as on a workstation, on GPU nodes of the target GPU (GPU Feature Discovery
product label, the usual nvidia.com/gpu taint tolerated), with the artifacts claim at /artifacts and the
plan the operator wrote at /plan. A multi-node stage is an Indexed Job whose pods find each other through a
headless Service and start torchrun with their completion index as node rank. Results come back as the
container's termination message (`--result-file /dev/termination-log`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from tailor.operator.deployment import GPU_TAINT_TOLERATION, RESTRICTED, owner_reference
from tailor.operator.pools import GPU_RESOURCE, PRODUCT_LABEL

Stage = Literal["compress", "quantize", "evaluate", "package"]
ARTIFACTS = "/artifacts"
PLAN = "/plan"
SOURCE = "/source"
RENDEZVOUS_PORT = 29500
JOB_SERVICE_ACCOUNT = "tailor-job"


class JobSettings(BaseModel):
    """Resources and limits of one stage's Job."""

    image: str = Field(min_length=1)
    service_account: str = Field(JOB_SERVICE_ACCOUNT, min_length=1)
    gpus_per_node: int = Field(1, ge=0, le=16)  # 0: a CPU-only step (packaging)
    nodes: int = Field(1, ge=1, le=64)
    backoff_limit: int = Field(2, ge=0, le=100)
    active_deadline_seconds: int = Field(7 * 24 * 3600, ge=60)


def job_name(model: dict[str, Any], generation: int, stage: Stage, suffix: str = "") -> str:
    return f"{model['metadata']['name']}-g{generation}-{stage}{f'-{suffix}' if suffix else ''}"


def launcher(name: str, settings: JobSettings, args: list[str]) -> list[str]:
    """The container command: tailor itself, or torchrun around it for more than one GPU or node."""
    if settings.nodes > 1:
        return ["sh", "-c", f"exec torchrun --nnodes {settings.nodes} --nproc-per-node {settings.gpus_per_node} "
                f"--node-rank $JOB_COMPLETION_INDEX --master-addr {name}-0.{name} --master-port {RENDEZVOUS_PORT} "
                f"-m tailor.cli.main {' '.join(args)}"]
    if settings.gpus_per_node > 1:
        return ["torchrun", "--standalone", f"--nproc-per-node={settings.gpus_per_node}", "-m", "tailor.cli.main",
                *args]
    return ["tailor", *args]


def stage_job(model: dict[str, Any], stage: Stage, generation: int, args: list[str], settings: JobSettings,
              gpu_product: str, claim: str, plan_config_map: str, pod_annotations: dict[str, str] | None = None,
              source_claim: str | None = None, suffix: str = "", env: list[dict[str, Any]] | None = None
              ) -> list[dict[str, Any]]:
    """The Job (and, for several nodes, its headless Service) running `tailor <args>` for a stage of the
    generation `generation`; a pvc:// source's claim is mounted read-only at /source."""
    name = job_name(model, generation, stage, suffix)
    labels = {"app.kubernetes.io/managed-by": "tailor", "tailor.dev/model": model["metadata"]["name"],
              "tailor.dev/stage": stage, "tailor.dev/generation": str(generation)}
    meta = {"name": name, "namespace": model["metadata"]["namespace"], "labels": labels,
            "ownerReferences": [owner_reference(model)]}
    gpus = {GPU_RESOURCE: str(settings.gpus_per_node)} if settings.gpus_per_node else {}
    mounts = [{"name": "artifacts", "mountPath": ARTIFACTS}, {"name": "plan", "mountPath": PLAN, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "artifacts", "persistentVolumeClaim": {"claimName": claim}},
                                     {"name": "plan", "configMap": {"name": plan_config_map}}]
    if source_claim is not None:
        mounts.append({"name": "source", "mountPath": SOURCE, "readOnly": True})
        volumes.append({"name": "source", "persistentVolumeClaim": {"claimName": source_claim, "readOnly": True}})
    pod: dict[str, Any] = {
        "metadata": {"labels": labels, "annotations": dict(pod_annotations or {})},
        "spec": {
            "restartPolicy": "Never",
            "serviceAccountName": settings.service_account,
            "automountServiceAccountToken": False,  # the stages never call the Kubernetes API
            "nodeSelector": {PRODUCT_LABEL: gpu_product},
            "tolerations": [GPU_TAINT_TOLERATION],
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
            "containers": [{
                "name": stage, "image": settings.image, "command": launcher(name, settings, args),
                "env": list(env or []),
                "resources": {"limits": gpus, "requests": gpus},
                "volumeMounts": mounts,
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "securityContext": RESTRICTED,
            }],
            "volumes": volumes,
        },
    }
    spec: dict[str, Any] = {"backoffLimit": settings.backoff_limit,
                            "activeDeadlineSeconds": settings.active_deadline_seconds, "template": pod}
    objects: list[dict[str, Any]] = []
    if settings.nodes > 1:  # one pod per node, all of its GPUs: the ranks find each other by DNS
        pod["spec"]["subdomain"] = name
        pod["spec"]["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}]}}
        spec.update(completionMode="Indexed", completions=settings.nodes, parallelism=settings.nodes)
        objects.append({"apiVersion": "v1", "kind": "Service", "metadata": meta,
                        "spec": {"clusterIP": "None", "selector": labels,
                                 "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}]}})
    objects.insert(0, {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec})
    return objects
