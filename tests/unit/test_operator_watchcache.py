"""The watch cache's store: which of a watch's events and the operator's own writes it keeps, and what of them;
when a change wakes a pass (`handlers.moves_on`), and how often running builds' passes look at their logs. The
list-and-watch itself runs against the real API server in tests/cluster/test_watchcache.py."""

from __future__ import annotations

from typing import Any

from tailor.operator.decision import PROGRESS_REQUEUE_S
from tailor.operator.handlers import PROGRESS_PASSES_PER_S, RUNTIME, moves_on, progress_spaced
from tailor.operator.watchcache import Store

LABELS = {"tailor.dev/model": "m"}


def obj(name: str, version: int, uid: str = "u1", namespace: str = "ns", **extra: Any) -> dict[str, Any]:
    return {"kind": "Job", "metadata": {"name": name, "namespace": namespace, "uid": uid, "labels": LABELS,
                                        "resourceVersion": str(version)}, **extra}


def test_an_event_older_than_what_the_store_holds_is_dropped() -> None:
    store = Store()
    assert store.apply("Job", "ADDED", obj("a", 5)) == {}  # new: changed, nothing before
    assert store.apply("Job", "MODIFIED", obj("a", 4)) is None  # stale: the operator's write was newer
    assert store.apply("Job", "MODIFIED", obj("a", 5)) is None  # already known: no second wake-up
    before = store.apply("Job", "MODIFIED", obj("a", 7, status={"active": 1}))
    assert before is not None and before["metadata"]["resourceVersion"] == "5"
    assert store.get("Job", "ns", "a")["status"] == {"active": 1}  # type: ignore[index]


def test_an_object_the_operator_deleted_stays_out_until_its_deleted_event() -> None:
    store = Store()
    store.apply("Job", "ADDED", obj("a", 5))
    store.forget("Job", "ns", "a")
    assert store.get("Job", "ns", "a") is None
    assert store.apply("Job", "MODIFIED", obj("a", 8)) is None  # the Job controller's last word, before it went
    assert store.get("Job", "ns", "a") is None
    assert store.apply("Job", "DELETED", obj("a", 9)) is None  # nothing held: no wake-up
    assert store.apply("Job", "ADDED", obj("a", 12, uid="u2")) == {}  # a new Job of that name
    assert store.get("Job", "ns", "a")["metadata"]["uid"] == "u2"  # type: ignore[index]


def test_a_deleted_event_removes_only_the_object_of_its_uid() -> None:
    store = Store()
    store.apply("Job", "ADDED", obj("a", 12, uid="u2"))
    assert store.apply("Job", "DELETED", obj("a", 9, uid="u1")) is None  # the earlier Job of that name
    assert store.get("Job", "ns", "a") is not None
    assert store.apply("Job", "DELETED", obj("a", 13, uid="u2")) is not None
    assert store.get("Job", "ns", "a") is None


def test_a_store_has_reached_what_its_list_and_watch_brought() -> None:
    store = Store()
    assert not store.reached("Pod", "ns", 1)  # not listed yet
    store.replace("Pod", "ns", [], version=10)
    assert store.reached("Pod", "ns", 10) and not store.reached("Pod", "ns", 11)
    store.advance("Pod", "ns", 15)
    store.advance("Pod", "ns", 12)  # never back
    assert store.reached("Pod", "ns", 15) and not store.reached("Pod", "ns", 16)
    store.replace("Pod", None, [], version=30)  # a cluster-wide list and watch
    assert store.reached("Pod", "other", 30) and not store.reached("Job", "ns", 1)


def test_a_list_replaces_what_was_held_but_keeps_the_operators_newer_writes() -> None:
    store = Store()
    assert not store.synced("Job", "ns")
    store.apply("Job", "ADDED", obj("gone", 3))
    store.put("Job", obj("written", 11, uid="u3"))  # created after the list's snapshot
    store.apply("Job", "ADDED", obj("other", 4, uid="u4", namespace="other"))
    store.replace("Job", "ns", [obj("listed", 9, uid="u5")], version=10)
    assert store.synced("Job", "ns") and not store.synced("Job", "other")
    assert sorted(o["metadata"]["name"] for o in store.select("Job", "ns", LABELS)) == ["listed", "written"]
    assert store.get("Job", "other", "other") is not None  # another namespace's list is not this one's
    store.replace("Job", None, [], version=20)  # a cluster-wide list
    assert store.synced("Job", "other") and store.select("Job", "ns", LABELS) == []
    store.unsync("Job", None)
    assert not store.synced("Job", "other")


def test_select_matches_labels_and_returns_copies() -> None:
    store = Store()
    store.apply("Job", "ADDED", obj("a", 5))
    store.apply("Job", "ADDED", {"metadata": {"name": "b", "namespace": "ns", "uid": "u9", "resourceVersion": "6",
                                              "labels": {"tailor.dev/model": "n"}}})
    found = store.select("Job", "ns", LABELS)
    assert [o["metadata"]["name"] for o in found] == ["a"]
    found[0]["metadata"]["name"] = "mutated by a pass"
    assert store.get("Job", "ns", "a") is not None
    relabelled = obj("a", 7)
    relabelled["metadata"]["labels"] = {"tailor.dev/model": "n"}
    store.apply("Job", "MODIFIED", relabelled)
    assert store.select("Job", "ns", LABELS) == []
    assert sorted(o["metadata"]["name"] for o in store.select("Job", "ns", {"tailor.dev/model": "n"})) == ["a", "b"]


def test_passes_wake_on_spec_changes_finished_jobs_and_available_revisions_only() -> None:
    model = {"metadata": {"name": "m", "uid": "u"}, "spec": {"a": 1}, "status": {"phase": "Pending"}}
    assert moves_on("CompressedModel", "ADDED", None, model)
    assert not moves_on("CompressedModel", "MODIFIED", model, {**model, "status": {"phase": "Compressing"}})
    assert moves_on("CompressedModel", "MODIFIED", model, {**model, "spec": {"a": 2}})
    deleting = {**model, "metadata": {**model["metadata"], "deletionTimestamp": "2026-12-04T00:00:00Z"}}
    assert moves_on("CompressedModel", "MODIFIED", model, deleting)
    running = obj("a", 5, status={"active": 8})
    assert not moves_on("Job", "MODIFIED", None, running)
    assert moves_on("Job", "MODIFIED", running, obj("a", 6, status={"conditions": [
        {"type": "Complete", "status": "True"}]}))
    assert moves_on("Job", "DELETED", None, running)
    revision = {"metadata": {"name": "r", "generation": 2}, "spec": {"replicas": 3}}
    assert not moves_on("Deployment", "MODIFIED", None, {**revision, "status": {
        "observedGeneration": 2, "availableReplicas": 2}})
    assert not moves_on("Deployment", "MODIFIED", None, {**revision, "status": {
        "observedGeneration": 1, "availableReplicas": 3}})
    assert not moves_on("Deployment", "MODIFIED", None, {**revision, "status": {
        "observedGeneration": 2, "availableReplicas": 3}})  # some of the old pods still count
    assert moves_on("Deployment", "MODIFIED", None, {**revision, "status": {
        "observedGeneration": 2, "availableReplicas": 3, "updatedReplicas": 3}})
    assert not moves_on("Pod", "MODIFIED", None, obj("p", 3))
    assert not moves_on("ConfigMap", "DELETED", None, obj("c", 3))


def test_what_no_pass_reads_is_not_kept() -> None:
    store = Store()
    pod = obj("p", 3, spec={"containers": [{"name": "compress"}]}, status={"phase": "Running"})
    pod["metadata"]["managedFields"] = [{"manager": "kube-scheduler"}]
    store.apply("Pod", "ADDED", pod)
    kept = store.get("Pod", "ns", "p")
    assert kept is not None and "spec" not in kept and "managedFields" not in kept["metadata"]
    assert kept["status"] == {"phase": "Running"}
    store.apply("Job", "ADDED", obj("j", 3, spec={"parallelism": 6}))
    assert store.get("Job", "ns", "j")["spec"] == {"parallelism": 6}  # type: ignore[index]


def test_running_builds_look_at_their_logs_at_most_so_often_all_together() -> None:
    RUNTIME.progressing.clear()
    assert progress_spaced("a", 30.0) == 30.0  # not a running build: its own requeue
    assert progress_spaced("a", PROGRESS_REQUEUE_S) == PROGRESS_REQUEUE_S  # one build: every 10 s
    for uid in range(199):
        progress_spaced(str(uid), PROGRESS_REQUEUE_S)
    assert progress_spaced("a", PROGRESS_REQUEUE_S) == 200 / PROGRESS_PASSES_PER_S  # 200 builds: 40 s each
    assert progress_spaced("a", 300.0) == 300.0 and len(RUNTIME.progressing) == 199  # its build ended
    RUNTIME.progressing.clear()
