"""`tailor operator-release`: let CompressedModels go without the operator. The chart's pre-delete hook runs it on
`helm uninstall`; run it by hand for a namespace that leaves `watchNamespaces`.

Every CompressedModel carries Tailor's finalizer, which only the operator removes (after stopping the object's Jobs
and revisions): with no operator watching, deleting one would wait forever. This stops the operator first (its
Deployment scaled to zero, its pods gone: a running operator would add the finalizer back), then removes the
finalizer from every CompressedModel in the namespaces given. The objects stay; deleting one afterwards takes its
Jobs and revisions with it (they are owned by it), but not its artifacts claim (which is not): `kubectl delete pvc
<name>-artifacts` where `storage.deletionPolicy` was Delete. An operator installed again adds the finalizer back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kubernetes import client

from tailor.operator import login, names
from tailor.operator.api import API_VERSION, GROUP, PLURAL


def stop_operator(api: client.ApiClient, namespace: str, name: str, timeout_s: float) -> None:
    """Scale the operator's Deployment to zero and wait until none of its pods is left."""
    apps = client.AppsV1Api(api)
    apps.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": 0}})
    selector: Any = apps.read_namespaced_deployment(name, namespace).spec.selector.match_labels
    labels = ",".join(f"{key}={value}" for key, value in sorted(selector.items()))
    deadline = time.monotonic() + timeout_s
    while client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=labels).items:
        if time.monotonic() > deadline:
            raise TimeoutError(f"deployment {namespace}/{name}: its pods are still there after {timeout_s:.0f} s")
        time.sleep(1)


def release(api: client.ApiClient, namespaces: list[str] | None, say: Callable[[str], None] = print) -> int:
    """Remove Tailor's finalizer from every CompressedModel in `namespaces` (None: all); how many had it. Each
    removal is a JSON patch that first tests the entry it removes, so no other finalizer is touched."""
    objects = client.CustomObjectsApi(api)
    found: list[dict[str, Any]] = []
    for namespace in namespaces if namespaces is not None else [None]:
        listed: Any = (objects.list_cluster_custom_object(GROUP, API_VERSION, PLURAL) if namespace is None
                       else objects.list_namespaced_custom_object(GROUP, API_VERSION, namespace, PLURAL))
        found += listed["items"]
    released = 0
    for item in found:
        meta = item["metadata"]
        finalizers = meta.get("finalizers") or []
        if names.FINALIZER not in finalizers:
            continue
        index = finalizers.index(names.FINALIZER)
        path = f"/metadata/finalizers/{index}"
        objects.patch_namespaced_custom_object(
            GROUP, API_VERSION, meta["namespace"], PLURAL, meta["name"],
            [{"op": "test", "path": path, "value": names.FINALIZER}, {"op": "remove", "path": path}],
            _content_type="application/json-patch+json")
        released += 1
        say(f"released {meta['namespace']}/{meta['name']}")
    return released


def run(deployment: str | None, namespaces: list[str] | None, timeout_s: float) -> int:
    """Stop the operator's `deployment` (NAMESPACE/NAME, if given), then release the namespaces' objects."""
    api = client.ApiClient(login.load_config())
    if deployment is not None:
        namespace, _, name = deployment.partition("/")
        if not namespace or not name:
            raise ValueError(f"--stop {deployment!r}: expected NAMESPACE/NAME")
        stop_operator(api, namespace, name, timeout_s)
        print(f"stopped deployment {deployment}")
    return release(api, namespaces)
