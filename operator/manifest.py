"""What every manifest the operator writes shares, each rule once: the metadata of an object a CompressedModel owns
and the test of who owns one; what a pod gets per GPU (requests, a memory limit, a memory-backed /dev/shm) and its
security contexts; when a Job has finished and a Deployment is available; Kubernetes quantities.
"""

from __future__ import annotations

import math
from typing import Any

from tailor.compressor.sizing.hostmemory import HostNeed, stage_need
from tailor.operator import names
from tailor.operator.api import API_VERSION, GPU_RESOURCE, GROUP, KIND, QUANTITY_UNITS

# --- quantities ----------------------------------------------------------------------------------

_SUFFIXES = sorted(QUANTITY_UNITS, key=len, reverse=True)  # Mi before M and m


def _unit(quantity: str) -> str:
    """A quantity's suffix; "" for a plain number."""
    return next((suffix for suffix in _SUFFIXES if quantity.endswith(suffix)), "")


def quantity_value(quantity: str) -> float:
    """A Kubernetes quantity (2Gi, 500m, 1.5T) as a number."""
    unit = _unit(quantity)
    return float(quantity[:-len(unit)]) * QUANTITY_UNITS[unit] if unit else float(quantity)


def decimal_quantity(value: float) -> str:
    """A number as a quantity: whole, else in thousandths (0.8 is 800m)."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def scaled(per_gpu: dict[str, str], gpus: int) -> dict[str, str]:
    """Resource quantities for `gpus` GPUs from whole per-GPU quantities like 500m or 2Gi, in the same unit."""
    out = {}
    for resource, quantity in per_gpu.items():
        unit = _unit(quantity)
        out[resource] = f"{int(quantity[:len(quantity) - len(unit)]) * gpus}{unit}"
    return out


# --- metadata ------------------------------------------------------------------------------------


def object_reference(model: dict[str, Any]) -> dict[str, Any]:
    """The CompressedModel as another object names it (an Event's involvedObject)."""
    meta = model["metadata"]
    return {"apiVersion": f"{GROUP}/{API_VERSION}", "kind": KIND, "name": meta["name"], "uid": meta["uid"]}


def owner_reference(model: dict[str, Any]) -> dict[str, Any]:
    """The CompressedModel as its objects' controller: they go when it goes."""
    return {**object_reference(model), "controller": True, "blockOwnerDeletion": True}


def owned_metadata(model: dict[str, Any], name: str, labels: dict[str, str], by_label: bool = False
                   ) -> dict[str, Any]:
    """The metadata of `model`'s object `name` in its namespace: owned through an owner reference, or `by_label`
    through the owner's uid label (the claim, which deletionPolicy Retain keeps after the object goes)."""
    if by_label:
        return {"name": name, "namespace": model["metadata"]["namespace"],
                "labels": {**labels, names.MODEL_UID: model["metadata"]["uid"]}}
    return {"name": name, "namespace": model["metadata"]["namespace"], "labels": labels,
            "ownerReferences": [owner_reference(model)]}


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether the object of uid `uid` owns `obj`, by owner reference or uid label (`owned_metadata`)."""
    meta = obj["metadata"]
    return (any(ref.get("uid") == uid for ref in meta.get("ownerReferences") or [])
            or (meta.get("labels") or {}).get(names.MODEL_UID) == uid)


def owner_uid(obj: dict[str, Any]) -> str | None:
    """The uid of the CompressedModel that `obj` names as its owner (by owner reference or uid label), if any."""
    meta = obj.get("metadata", {})
    return next((ref.get("uid") for ref in meta.get("ownerReferences") or [] if ref.get("kind") == KIND),
                (meta.get("labels") or {}).get(names.MODEL_UID))


# --- pods ----------------------------------------------------------------------------------------

RESTRICTED = {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
              "seccompProfile": {"type": "RuntimeDefault"}, "readOnlyRootFilesystem": True}
# Every Tailor container writes only to mounted folders: the claim, /dev/shm, and its scratch folder (an emptyDir
# at SCRATCH), where HOME and the caches the engines write at start go (vLLM's compile cache, Triton-lang's JIT
# kernels, torch inductor's, a config class trust_remote_code loads): an image's user may have no home (NVIDIA's
# Triton image makes uid 1000 without one), and the root filesystem is read-only. Per pod: a cache on the claim
# would let a serving pod write code that every later replica runs.
SCRATCH = "/tmp"
SCRATCH_LIMIT = "20Gi"
SCRATCH_ENV = {"HOME": f"{SCRATCH}/home", "TMPDIR": SCRATCH, "XDG_CACHE_HOME": f"{SCRATCH}/cache",
               "VLLM_CACHE_ROOT": f"{SCRATCH}/cache/vllm", "TRITON_CACHE_DIR": f"{SCRATCH}/cache/triton",
               "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH}/cache/inductor"}
SCRATCH_MOUNT = {"name": "scratch", "mountPath": SCRATCH}
SCRATCH_VOLUME = {"name": "scratch", "emptyDir": {"sizeLimit": SCRATCH_LIMIT}}
# Triton's Python backend hands each request's tensors to the model's stub through /dev/shm: a pod serving
# requests needs room for those in flight (the runtime's default is 64 MiB, and one prompt of 10^6 tokens is
# about 16 MB as text and ids)
SHM_BASE_MIB = 64  # the backend's first region and its messages
SHM_BYTES_PER_TOKEN = 24  # a request's prompt as UTF-8 text (up to 16 bytes a token) and as int64 ids
# fsGroup makes the claim writable; OnRootMismatch skips the recursive chown of a large claim on every start
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000, "fsGroupChangePolicy": "OnRootMismatch"}
REQUESTS_PER_GPU = {"cpu": "500m", "memory": "2Gi"}  # a floor that keeps a GPU pod out of BestEffort
SHM_PER_GPU_GIB = 8


def gpu_count(quantities: dict[str, Any] | None) -> int:
    """The whole GPUs a resource list (allocatable, requests, limits) names; 0 when it names none."""
    value = str((quantities or {}).get(GPU_RESOURCE, "0"))
    return int(value) if value.isdigit() else 0


def container_gpus(container: dict[str, Any]) -> int:
    """A container's GPUs: its limit (extended resources must have one), else its request."""
    resources = container.get("resources") or {}
    return gpu_count(resources.get("limits")) or gpu_count(resources.get("requests"))


def as_env(values: dict[str, str]) -> list[dict[str, str]]:
    """A container's `env` entries for `values`."""
    return [{"name": name, "value": value} for name, value in values.items()]


def shm_bytes(gpus: int, tokens_in_flight: int | None = None) -> int:
    """The memory-backed /dev/shm a pod of `gpus` GPUs gets: SHM_PER_GPU_GIB per GPU where tensor-parallel workers
    exchange through it (none for one GPU), and for a Triton pod (`tokens_in_flight`: the most tokens its requests
    hold at once; None for a pod without Triton) what its Python backend hands the model."""
    workers = SHM_PER_GPU_GIB * 2**30 * gpus if gpus > 1 else 0
    served = 0 if tokens_in_flight is None else SHM_BASE_MIB * 2**20 + SHM_BYTES_PER_TOKEN * tokens_in_flight
    return workers + served


def shared_memory(gpus: int, tokens_in_flight: int | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The /dev/shm of a container of `gpus` GPUs (`shm_bytes`), as its volume mounts and the pod's volumes: none
    where it needs none (one GPU, no Triton). NCCL, torch's shared-memory tensors and Triton's Python backend need
    more than the runtime's 64 MiB default."""
    size = shm_bytes(gpus, tokens_in_flight)
    if not size:
        return [], []
    return ([{"name": "shm", "mountPath": "/dev/shm"}],
            [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{math.ceil(size / 2**20)}Mi"}}])


def memory_bounds(host: HostNeed | None, gpus: int, tokens_in_flight: int | None = None
                  ) -> tuple[dict[str, str], dict[str, str]]:
    """Requests and limits for a pod of `gpus` GPUs that holds `host` in RAM (None: a stage's allowance): the
    per-GPU floor, a request of the need where it is this model's footprint (an allowance is only a bound), and
    the limit with headroom and the pod's /dev/shm (`shm_bytes`)."""
    host = host or stage_need(gpus)
    requests = scaled(REQUESTS_PER_GPU, max(1, gpus))
    if not host.assumed:
        requests["memory"] = max(requests["memory"], host.request(), key=quantity_value)
    return requests, {"memory": host.limit(shm_bytes(gpus, tokens_in_flight))}


# --- status --------------------------------------------------------------------------------------


def finishing_condition(job: dict[str, Any]) -> dict[str, Any] | None:
    """The Job's `Complete` or `Failed` condition once the Job controller sets it, else None."""
    return next((condition for condition in (job.get("status") or {}).get("conditions") or []
                 if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True"), None)


def job_finished(job: dict[str, Any]) -> str | None:
    """`Complete` or `Failed` once the Job controller says so, else None."""
    condition = finishing_condition(job)
    return None if condition is None else str(condition["type"])


def deployment_available(deployment: dict[str, Any], floor: int | None = None) -> tuple[bool, int]:
    """Whether a Deployment is available at its current spec, and its available replicas. One that serves already
    needs only `floor` of them (its HPA's minReplicas): the replicas the HPA adds while they start, or drains
    while they stop, do not make it unavailable."""
    status, wanted = deployment.get("status") or {}, (deployment.get("spec") or {}).get("replicas", 1)
    count = int(status.get("availableReplicas", 0))
    if floor is not None:  # a scale's new generation is not waited for either
        return count >= min(wanted, floor), count
    current = status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 1)
    return current and count >= wanted and status.get("updatedReplicas", 0) >= wanted, count
