"""What one reconciliation pass sees: the object and everything of it the API server holds, selected by the
`tailor.dev/model` label from the operator's watch cache (or listed, while the cache has not listed a kind), plus
the claim, the nodes when pools are sized or the build's batch is taken from
them, the GPUs pods hold on nodes when pools are sized, the termination messages of finished Jobs whose result the
status has not taken yet, why Jobs that have not started wait (Kueue's Workload of a suspended Job, the scheduler's
word on a pod), and the last lines of each running build stage's log (`progress`).

`Observed` is plain data; `decide` turns it into actions without any I/O, so tests build one by hand
(tests/unit/test_operator_decide_table.py).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from tailor.compressor.buildplan import BUILD_STAGES
from tailor.operator import names
from tailor.operator.kube import Kube
from tailor.operator.manifest import job_finished
from tailor.operator.placement import KUEUE_QUEUE_LABEL
from tailor.operator.pools import GpuHolders
from tailor.operator.progress import LOG_TAIL_LINES
from tailor.operator.watchcache import resource_version

BUILD_KINDS = ("Job", "ConfigMap")
SERVING_KINDS = ("Deployment", "Service")  # none exist before the build has a child to size them for


@dataclass(frozen=True)
class Observed:
    """The object and the objects carrying its name label, by kind and name (owned or not: `decide`
    checks the owner before it adopts anything)."""

    model: dict[str, Any]
    objects: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    claim: dict[str, Any] | None = None  # the claim the object writes to (its own or the existingClaim)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    gpu_pods: GpuHolders | None = field(default_factory=lambda: GpuHolders(pods=[]))  # None: not listable
    results: dict[str, str] = field(default_factory=dict)  # Job name -> its rank-0 pod's termination message
    with_pods: frozenset[str] = frozenset()  # finished Jobs whose pods are still there (when results were read)
    waiting: dict[str, str] = field(default_factory=dict)  # Job name -> why its pods do not run yet
    evidence: dict[str, str] = field(default_factory=dict)  # stalled Deployment -> what its pods say
    unscheduled: frozenset[str] = frozenset()  # stalled Deployments with a pod the scheduler found no room for
    named_claims: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # the spec's source/data claims
    logs: dict[str, str] = field(default_factory=dict)  # running build Job -> the end of its rank-0 pod's log
    now: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).replace(microsecond=0))

    def of(self, kind: str) -> dict[str, dict[str, Any]]:
        return self.objects.get(kind, {})


def _taken(job: dict[str, Any], status: dict[str, Any], records: Mapping[str, Any]) -> bool:
    """Whether the status, or for a package Job its record (`workloads.keep_record`), already holds what this
    finished Job had to say."""
    name = job["metadata"]["name"]
    if job_finished(job) == "Complete" and job["metadata"]["labels"].get(names.STAGE) == "package":
        return names.code_record_of(name) in records
    speed = status.get("servedSpeedup") or {}
    if speed.get("jobName") == name and speed.get("state") != "Running":
        return True
    return any(name in (s.get("jobName"), f"{s.get('jobName')}-r") and s.get("state") in ("Succeeded", "Failed")
               for s in status.get("stages") or [])


def job_of(pod: dict[str, Any]) -> str | None:
    """The Job a pod runs for (the Job controller's label), or None."""
    return (pod["metadata"].get("labels") or {}).get("batch.kubernetes.io/job-name")


def is_rank0(pod: dict[str, Any]) -> bool:
    """Whether a pod is rank 0 of its Job: index 0 of an Indexed Job, or the pod of a Job with one."""
    index = (pod["metadata"].get("annotations") or {}).get("batch.kubernetes.io/job-completion-index", "0")
    return bool(index == "0")


def pod_jobs(pods: list[dict[str, Any]]) -> frozenset[str]:
    return frozenset(job for pod in pods if (job := job_of(pod)) is not None)


def termination_messages(pods: list[dict[str, Any]]) -> dict[str, str]:
    """The newest termination message per Job, from rank 0 of an Indexed Job; a container killed for memory says
    so first, with its limit (its own message is then only its log's tail)."""
    found: dict[str, tuple[str, str]] = {}
    for pod in pods:
        meta, job = pod["metadata"], job_of(pod)
        if job is None or not is_rank0(pod):
            continue
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (container.get("state") or {}).get("terminated") or {}
            message = terminated.get("message")
            if terminated.get("reason") == "OOMKilled":
                limit = next((((c.get("resources") or {}).get("limits") or {}).get("memory") for c in
                              (pod.get("spec") or {}).get("containers") or [] if c.get("name") == container.get(
                                  "name")), None)
                message = (f"OOMKilled: container {container.get('name')} went over its memory limit {limit} (set "
                           "spec.jobs.resources.limits.memory to give it more)" + (f"; {message}" if message else ""))
            created = meta.get("creationTimestamp", "")
            if message and (job not in found or created > found[job][0]):
                found[job] = (created, str(message).strip())
    return {job: message for job, (_, message) in found.items()}


def not_scheduled(pod: dict[str, Any]) -> str | None:
    """The scheduler's reason it cannot place a pending pod (which resource, on which nodes), else None."""
    status = pod.get("status") or {}
    if status.get("phase") != "Pending":
        return None
    return next((str(c.get("message", "")) for c in status.get("conditions") or []
                 if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"), None)


def unschedulable(pods: list[dict[str, Any]]) -> dict[str, str]:
    """Per Job, the scheduler's reason for one of its pods it cannot place."""
    found: dict[str, str] = {}
    for pod in pods:
        job = job_of(pod)
        if job is not None and (why := not_scheduled(pod)) is not None:
            found[job] = f"pod {pod['metadata']['name']} cannot be scheduled: {why}"
    return found


def queued(job: dict[str, Any], workloads: list[dict[str, Any]]) -> str:
    """Why a suspended Job waits in its Kueue queue: its Workload's word on quota and admission."""
    queue = (job["metadata"].get("labels") or {}).get(KUEUE_QUEUE_LABEL)
    where = f"Kueue LocalQueue {queue}" if queue else "suspended, in no Kueue queue"
    if not workloads:
        return f"waiting in {where}: Kueue has made no Workload for it yet (is Kueue running, and the queue there?)"
    conditions = {c.get("type"): c for c in (workloads[0].get("status") or {}).get("conditions") or []}
    for kind in ("QuotaReserved", "Admitted"):
        condition = conditions.get(kind)
        if condition is not None and condition.get("status") != "True":
            return f"waiting in {where}: {condition.get('message') or condition.get('reason')}"
    return f"waiting in {where}: admitted, about to start"


def stalled(deployment: dict[str, Any]) -> str | None:
    """The Deployment controller's message once the revision is past its progress deadline, else None."""
    for condition in (deployment.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Progressing" and condition.get("reason") == "ProgressDeadlineExceeded":
            return str(condition.get("message") or "ProgressDeadlineExceeded")
    return None


EVIDENCE_PODS = 3  # of a failed revision, the pods whose state is kept (the first few say what the rest do)
EVIDENCE_CHARS = 1500  # of each container's last log lines


def pod_evidence(pods: list[dict[str, Any]]) -> str:
    """What a revision's pods say about why they are not ready: scheduling, each container's state, restarts,
    and the last log lines a crashed container left as its termination message."""
    lines = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"])[:EVIDENCE_PODS]:
        status, name = pod.get("status") or {}, pod["metadata"]["name"]
        said = [f"pod {name}: {status.get('phase', 'Unknown')}"]
        for condition in status.get("conditions") or []:
            if condition.get("status") == "False" and condition.get("message"):
                said.append(f"{condition.get('type')}: {condition['message']}")
        for container in status.get("containerStatuses") or []:
            state = container.get("state") or {}
            waiting, last = state.get("waiting"), (container.get("lastState") or {}).get("terminated")
            if waiting:
                said.append(f"{container['name']} waiting ({waiting.get('reason')}): {waiting.get('message', '')}")
            if container.get("restartCount"):
                said.append(f"{container['name']} restarted {container['restartCount']} time(s)")
            if last:
                said.append(f"{container['name']} last exited {last.get('exitCode')} ({last.get('reason')}); its "
                            f"last log lines: {str(last.get('message', '')).strip()[-EVIDENCE_CHARS:]}")
        lines.append("; ".join(said))
    if len(pods) > EVIDENCE_PODS:
        lines.append(f"(and {len(pods) - EVIDENCE_PODS} more pod(s))")
    return "\n".join(lines) or "no pod of it exists"


def running_rank0(pods: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """Per Job of a build stage, its running rank-0 pod and the stage's container (named as the stage)."""
    found = {}
    for pod in pods:
        job, stage = job_of(pod), (pod["metadata"].get("labels") or {}).get(names.STAGE)
        if (job is not None and stage in BUILD_STAGES and (pod.get("status") or {}).get("phase") == "Running"
                and is_rank0(pod)):
            found[job] = (pod["metadata"]["name"], stage)
    return found


def _log_tail(kube: Kube, owner: str, namespace: str, pod: str, container: str) -> str:
    try:
        return kube.pod_log(owner, namespace, pod, container, LOG_TAIL_LINES)
    except ApiException:  # no kubelet answers for the node (a simulated one), or the pod just ended
        return ""


def _workloads(kube: Kube, owner: str, namespace: str, job: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        return kube.select(owner, "Workload", namespace, {"kueue.x-k8s.io/job-uid": job["metadata"]["uid"]})
    except ApiException as error:
        if error.status in (403, 404):  # Kueue is not installed, or the operator may not read its Workloads
            return []
        raise


def named_claims(spec: dict[str, Any]) -> set[str]:
    """The claims the spec names for the stages to read: a pvc:// source's and spec.compression.data's (as
    stored: `decide` validates the spec)."""
    uri = str((spec.get("source") or {}).get("uri") or "")
    data = (spec.get("compression") or {}).get("data") or {}
    found = {uri.removeprefix("pvc://").partition("/")[0]} if uri.startswith("pvc://") else set()
    return found | ({str(data["claimName"])} if isinstance(data, dict) and data.get("claimName") else set())


def observe(kube: Kube, namespace: str, name: str) -> Observed | None:
    """Everything a pass needs; None once the object is gone or going."""
    owner = f"{namespace}/{name}"
    model = kube.get(owner, "CompressedModel", namespace, name)
    if model is None or model["metadata"].get("deletionTimestamp"):
        return None
    selector = {names.MODEL: name}
    spec, status = model.get("spec") or {}, model.get("status") or {}
    built = (status.get("build") or {}).get("childConfig") is not None or status.get("servingGeneration") is not None
    objects = {kind: {o["metadata"]["name"]: o for o in kube.select(owner, kind, namespace, selector)}
               for kind in BUILD_KINDS + (SERVING_KINDS if built else ())}
    claim_name = ((spec.get("storage") or {}).get("existingClaim")) or names.claim_name(name)
    claim = kube.get(owner, "PersistentVolumeClaim", namespace, claim_name)
    named = {found: kube.get(owner, "PersistentVolumeClaim", namespace, found) for found in named_claims(spec)}
    stalled_revisions = [d for d in objects.get("Deployment", {}).values() if stalled(d) is not None]
    pods: list[dict[str, Any]] = []
    unfinished = [job for job in objects["Job"].values() if job_finished(job) is None]
    waiting_jobs = [job for job in unfinished if not (job.get("status") or {}).get("ready")]
    untaken = [job for job in objects["Job"].values()
               if job_finished(job) and not _taken(job, status, objects.get("ConfigMap", {}))]
    if stalled_revisions or unfinished or untaken:  # a finished Job's result: its pods as they were when it finished
        pods = kube.select(owner, "Pod", namespace, selector, not_older_than=max(
            (resource_version(job) for job in untaken), default=None))
    waiting = unschedulable(pods)
    for job in waiting_jobs:
        if (job.get("spec") or {}).get("suspend"):
            waiting[job["metadata"]["name"]] = queued(job, _workloads(kube, owner, namespace, job))
    running = {job["metadata"]["name"] for job in unfinished}
    logs = {job: _log_tail(kube, owner, namespace, pod, container)
            for job, (pod, container) in running_rank0(pods).items() if job in running}
    revision_pods = {d["metadata"]["name"]: [pod for pod in pods if names.selects(
        d["spec"]["selector"]["matchLabels"], pod["metadata"].get("labels"))] for d in stalled_revisions}
    evidence = {name: pod_evidence(found) for name, found in revision_pods.items()}
    unscheduled = frozenset(name for name, found in revision_pods.items()
                            if any(not_scheduled(pod) is not None for pod in found))
    batch_from_pools = (spec.get("compression") or {}).get("batch") is None
    needs_nodes = spec.get("deployment") and (built or batch_from_pools)
    return Observed(model=model, objects=objects, claim=claim, nodes=kube.nodes(owner) if needs_nodes else [],
                    gpu_pods=kube.gpu_pods(owner) if needs_nodes and built else GpuHolders(pods=[]),
                    results=termination_messages(pods), with_pods=pod_jobs(pods), waiting=waiting,
                    evidence=evidence, unscheduled=unscheduled, logs=logs, named_claims=named)
