"""`tailor operator-check`, the chart's `helm test`: the CRD is served and the operator is live.

Live means its Deployment is available at its current generation: the pod's readiness probe is kopf's
/healthz, which answers only while the operator's watches run. Its ServiceAccount may read only that
Deployment; API discovery needs no role.
"""

from __future__ import annotations

import time
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tailor.operator import login
from tailor.operator.api import API_VERSION, GROUP, PLURAL


def crd_served(api: client.ApiClient) -> str | None:
    """None when the API server serves compressedmodels, else what it serves instead."""
    found: Any = client.CustomObjectsApi(api).get_api_resources(GROUP, API_VERSION)
    resources = [r.name for r in found.resources]
    return None if PLURAL in resources else f"{GROUP}/{API_VERSION} serves {resources}, not {PLURAL}"


def operator_available(api: client.ApiClient, namespace: str, name: str) -> str | None:
    """None when the operator's Deployment is available at its current generation, else why not. Looser than
    `manifest.deployment_available`, on purpose: one replica serving is an operator up, whatever its spec asks."""
    deployment: Any = client.AppsV1Api(api).read_namespaced_deployment(name, namespace)
    status = deployment.status
    if (status.observed_generation or 0) < deployment.metadata.generation:
        return f"deployment {namespace}/{name}: generation {deployment.metadata.generation} not yet observed"
    if not status.available_replicas:
        return f"deployment {namespace}/{name}: no available replica (its /healthz readiness probe fails)"
    return None


def check(deployment: str, timeout_s: float) -> list[str]:
    """Both checks, retried until they pass or `timeout_s` ends; the problems left."""
    namespace, _, name = deployment.partition("/")
    if not namespace or not name:
        raise ValueError(f"--deployment {deployment!r}: expected NAMESPACE/NAME")
    api = client.ApiClient(login.load_config())
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            problems = [p for p in (crd_served(api), operator_available(api, namespace, name)) if p]
        except ApiException as error:
            problems = [f"HTTP {error.status} {error.reason}: {(error.body or '')[:300]}"]
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(2)
