"""The operator's watch cache against the real API server: it lists, then follows a watch; the operator's own
writes are in it before their events; a watch the server ends is reopened where it ended; a read that must be as new
as another object is served by the cache only once its watch has reached that object's resourceVersion."""

from __future__ import annotations

import threading
import time
from typing import Any

from kubernetes import client

from tailor.operator import names, watchcache
from tailor.operator.kube import Kube
from tailor.operator.watchcache import Reflector, Store

from conftest import wait_for

LABELS = {"tailor.dev/model": "cached"}


def config_map(name: str, namespace: str, data: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "data": {"k": data},
            "metadata": {"name": name, "namespace": namespace, "labels": LABELS}}


def test_the_cache_follows_the_server_and_the_operators_writes(api: client.ApiClient, namespace: str,
                                                                monkeypatch: Any) -> None:
    monkeypatch.setattr(watchcache, "WATCH_TIMEOUT_S", 2)  # the server ends each watch after 2 s
    core = client.CoreV1Api(api)
    core.create_namespaced_config_map(namespace, config_map("before", namespace, "1"))
    store, seen, lock = Store(), [], threading.Lock()

    def changed(kind: str, event: str, before: dict[str, Any] | None, after: dict[str, Any]) -> None:
        with lock:
            seen.append((event, after["metadata"]["name"], after.get("data", {}).get("k")))

    kube = Kube(api, store)
    reflector = Reflector(kube, "ConfigMap", namespace, changed)
    reflector.start()
    wait_for("the first list", lambda: store.synced("ConfigMap", namespace), timeout_s=30)
    assert [o["data"] for o in store.select("ConfigMap", namespace, LABELS)] == [{"k": "1"}]
    assert kube.select("o", "ConfigMap", namespace, LABELS)[0]["metadata"]["name"] == "before"
    assert kube.requests["o"] == 0  # read from the cache

    written = config_map("written", namespace, "2")
    written["metadata"]["labels"] = {**LABELS, names.MODEL_UID: "u1"}  # the operator deletes only its model's
    kube.create("o", written)
    assert store.get("ConfigMap", namespace, "written") is not None  # at once, before its watch event
    core.patch_namespaced_config_map("before", namespace, {"data": {"k": "3"}})  # another writer's change
    wait_for("another writer's change", lambda: ("MODIFIED", "before", "3") in seen, timeout_s=30)

    unlabelled = config_map("unlabelled", namespace, "4")
    unlabelled["metadata"]["labels"] = {}
    core.create_namespaced_config_map(namespace, unlabelled)
    assert kube.delete("o", "ConfigMap", namespace, "written", "u1")
    assert store.get("ConfigMap", namespace, "written") is None
    time.sleep(3 * watchcache.WATCH_TIMEOUT_S)  # the server has ended the watch at least once
    patched = core.patch_namespaced_config_map("before", namespace, {"data": {"k": "5"}})
    wait_for("a change after the watch was reopened", lambda: ("MODIFIED", "before", "5") in seen, timeout_s=30)
    assert store.reached("ConfigMap", namespace, int(patched.metadata.resource_version))
    assert reflector.thread.is_alive() and store.synced("ConfigMap", namespace)
    reflector.stop()
    assert {o["metadata"]["name"] for o in store.select("ConfigMap", namespace, LABELS)} == {"before"}
    assert store.get("ConfigMap", namespace, "unlabelled") is None  # outside the label: never cached
    reflector.thread.join(timeout=10)
    assert not reflector.thread.is_alive()


def test_a_read_as_new_as_another_object_waits_for_the_cache_or_asks_the_server(api: client.ApiClient,
                                                                                namespace: str) -> None:
    core = client.CoreV1Api(api)
    listed = core.list_namespaced_config_map(namespace, label_selector="tailor.dev/model=cached")
    store = Store()
    store.replace("ConfigMap", namespace, [], version=int(listed.metadata.resource_version))  # no watch follows it
    kube = Kube(api, store)
    core.create_namespaced_config_map(namespace, config_map("after-list", namespace, "1"))
    account = core.create_namespaced_service_account(namespace, {"metadata": {"name": "later"}})
    version = int(account.metadata.resource_version)  # a later write, of another kind

    assert kube.select("o", "ConfigMap", namespace, LABELS) == []  # the cache as it is: without it
    assert kube.requests["o"] == 0
    found = kube.select("o", "ConfigMap", namespace, LABELS, not_older_than=version)
    assert [o["metadata"]["name"] for o in found] == ["after-list"] and kube.requests["o"] == 1  # the server's

    store.advance("ConfigMap", namespace, version)  # as the watch would, with the ConfigMap's event
    assert kube.select("o", "ConfigMap", namespace, LABELS, not_older_than=version) == []  # the cache's
    assert kube.requests["o"] == 1
