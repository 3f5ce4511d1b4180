"""The devcluster's metrics pipeline, end to end: series scraped by Prometheus, served by prometheus-adapter with
the chart's rules through the API server's aggregation layer, read by a real HorizontalPodAutoscaler.

The series come from an exporter this test runs on loopback (a metrics source the test feeds): it reports
`vllm:num_requests_waiting` for the pods of a Deployment on a simulated GPU pool, whose pods run nowhere.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tailor.devcluster import cluster, metrics
from tailor.devcluster.simulated import published_results

from cmodels import OBJECTS, h100_example, wait_phase
from conftest import wait_for


class Exporter:
    """A Prometheus exporter on loopback: vLLM's gauges per pod, as the test sets them (`values` for
    `vllm:num_requests_waiting`, `kv_usage` for `vllm:kv_cache_usage_perc`), labelled with the pod's namespace and
    name (Prometheus honours them), listed in a file-discovery file of its own."""

    def __init__(self, layout: cluster.Layout, name: str) -> None:
        self.values: dict[tuple[str, str], float] = {}
        self.kv_usage: dict[tuple[str, str], float] = {}
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                lines = []
                for metric, values in (("vllm:num_requests_waiting", exporter.values),
                                       ("vllm:kv_cache_usage_perc", exporter.kv_usage)):
                    lines.append(f"# TYPE {metric} gauge")
                    lines += [f'{metric}{{namespace="{ns}",pod="{pod}"}} {value}'
                              for (ns, pod), value in sorted(values.items())]
                body = ("\n".join(lines) + "\n").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.file = metrics.scrape_folder(layout.root) / f"{name}.json"
        metrics.write_targets(self.file, [{"targets": [f"127.0.0.1:{self.server.server_port}"], "labels": {}}])

    def close(self) -> None:
        self.file.unlink(missing_ok=True)
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporter(devcluster: cluster.Layout, namespace: str) -> Iterator[Exporter]:
    fed = Exporter(devcluster, f"test-{namespace}")
    yield fed
    fed.close()


def _raw(kubectl: Callable[..., Any], path: str) -> dict[str, Any] | None:
    result = kubectl("get", "--raw", path, check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def test_custom_metrics_api_is_served_with_the_charts_rules(kubectl: Callable[..., Any]) -> None:
    discovery = wait_for("the custom metrics API", lambda: _raw(kubectl, "/apis/custom.metrics.k8s.io/v1beta1"))
    assert discovery["groupVersion"] == "custom.metrics.k8s.io/v1beta1"
    service = json.loads(kubectl("get", "apiservice", "v1beta1.custom.metrics.k8s.io", "-o", "json").stdout)
    available = next(c for c in service["status"]["conditions"] if c["type"] == "Available")
    assert available["status"] == "True", available


def test_hpa_scales_a_simulated_pool_on_the_waiting_requests(api: client.ApiClient, namespace: str,
                                                             kubectl: Callable[..., Any],
                                                             exporter: Exporter) -> None:
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    labels = {"app": "engine"}
    apps.create_namespaced_deployment(namespace, {
        "metadata": {"name": "engine"},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {
                     "nodeSelector": {"type": "kwok", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [{"name": "triton", "image": "triton"}]}}}})
    client.AutoscalingV2Api(api).create_namespaced_horizontal_pod_autoscaler(namespace, {
        "metadata": {"name": "engine"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "engine"},
                 "minReplicas": 1, "maxReplicas": 3,
                 "metrics": [{"type": "Pods", "pods": {"metric": {"name": "vllm_requests_waiting"},
                                                       "target": {"type": "AverageValue", "averageValue": "2"}}}]}})

    def running_pods() -> list[str]:
        pods = core.list_namespaced_pod(namespace, label_selector="app=engine").items
        return [p.metadata.name for p in pods if p.status.phase == "Running" and p.metadata.deletion_timestamp is None]

    first = wait_for("the first replica to run on kwok", running_pods)
    exporter.values = {(namespace, pod): 6 for pod in first}  # 6 waiting, 2 per replica wanted: 3 replicas

    path = f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{namespace}/pods/*/vllm_requests_waiting"
    served = wait_for("the adapter to serve the fed series",
                      lambda: [i for i in (_raw(kubectl, path) or {}).get("items", []) if i["value"] == "6"],
                      timeout_s=90, interval_s=2)
    assert [item["describedObject"]["name"] for item in served] == first

    def hpa() -> Any:
        return client.AutoscalingV2Api(api).read_namespaced_horizontal_pod_autoscaler(
            "engine", namespace)

    scaled = wait_for("the HPA to scale the Deployment to 3", lambda: hpa().status.desired_replicas == 3 and hpa(),
                      timeout_s=120, interval_s=2)
    current = scaled.status.current_metrics[0].pods.current.average_value
    assert current == "6", f"the HPA read {current}, the exporter reports 6"
    wait_for("3 replicas on the pool", lambda: len(running_pods()) == 3, timeout_s=60)
    conditions = {c.type: c for c in hpa().status.conditions}
    assert conditions["ScalingActive"].status == "True", conditions["ScalingActive"].message


def _nemotron(name: str) -> dict[str, Any]:
    """The H100 example on the simulated H100 pool: one replica of 8 requests of 10^6 tokens (a derived HPA target
    of 2 waiting per replica), at most 2; scale-down without a stabilisation window, so the test need not wait."""
    body = h100_example(name, published_results())
    body["spec"]["deployment"]["pools"][0]["concurrency"] = {"total": 8}
    body["spec"]["deployment"]["autoscaling"] = {"scaleDownStabilizationSeconds": 0}
    return body


@pytest.mark.timeout(400)  # Prometheus's scrape, the adapter's relist and the HPA's sync set the pace, not CPU
def test_nemotron_hpa_reads_fed_values_scales_within_its_bounds_and_the_pdb_holds(
        api: client.ApiClient, namespace: str, operator: Any, exporter: Exporter) -> None:
    objects, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    autoscaling, policy = client.AutoscalingV2Api(api), client.PolicyV1Api(api)
    OBJECTS.create(objects, namespace, _nemotron("super"))
    wait_phase(objects, namespace, "super", "Ready", operator)
    hpa = autoscaling.read_namespaced_horizontal_pod_autoscaler("super-h100-g1", namespace)
    assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (1, 2)
    assert [(m.pods.metric.name, m.pods.target.average_value) for m in hpa.spec.metrics] == [
        ("vllm_requests_waiting", "2"), ("vllm_kv_cache_usage", "900m")]  # 8 per replica / 4; the KV default

    def running() -> list[str]:
        pods = core.list_namespaced_pod(namespace, label_selector="tailor.dev/revision=g1").items
        return sorted(p.metadata.name for p in pods
                      if p.status.phase == "Running" and p.metadata.deletion_timestamp is None)

    (first,) = wait_for("the replica to run on kwok", running)
    exporter.values = {(namespace, first): 40}  # 40 waiting: 20 replicas wanted, maxReplicas is 2
    exporter.kv_usage = {(namespace, first): 0.5}

    def read() -> Any:
        now = autoscaling.read_namespaced_horizontal_pod_autoscaler("super-h100-g1", namespace)
        values = {m.pods.metric.name: m.pods.current.average_value for m in now.status.current_metrics or []
                  if m.pods is not None}
        return now if values == {"vllm_requests_waiting": "40", "vllm_kv_cache_usage": "500m"} else None

    wait_for("the HPA to read the fed values", read, timeout_s=120, interval_s=2)
    scaled = wait_for("the HPA to scale out", lambda: (h := read()) is not None and h.status.desired_replicas > 1
                      and h, timeout_s=60, interval_s=2)
    assert scaled.status.desired_replicas == 2, "the HPA went past maxReplicas"
    pods = wait_for("2 replicas on the H100 pool", lambda: len(running()) == 2 and running(), timeout_s=60)
    budget = wait_for("the PDB to count 2 healthy replicas", lambda: (b := policy.read_namespaced_pod_disruption_budget(
        "super-h100-g1", namespace)).status.current_healthy == 2 and b, timeout_s=30)
    assert budget.status.disruptions_allowed == 1

    exporter.values = {(namespace, pod): 0 for pod in pods}  # the queue is gone: back to minReplicas
    exporter.kv_usage = {(namespace, pod): 0.1 for pod in pods}
    wait_for("the HPA to scale in", lambda: autoscaling.read_namespaced_horizontal_pod_autoscaler(
        "super-h100-g1", namespace).status.desired_replicas == 1, timeout_s=120, interval_s=2)
    (last,) = wait_for("one replica left", lambda: len(running()) == 1 and running(), timeout_s=60)
    wait_for("the PDB to allow no disruption", lambda: policy.read_namespaced_pod_disruption_budget(
        "super-h100-g1", namespace).status.disruptions_allowed == 0, timeout_s=30)
    with pytest.raises(ApiException) as refused:  # a node drain may not take the last replica
        core.create_namespaced_pod_eviction(last, namespace, {"metadata": {"name": last, "namespace": namespace}})
    assert refused.value.status == 429 and "disruption budget" in refused.value.body
