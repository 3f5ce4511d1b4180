"""The devcluster's metrics pipeline: Prometheus scraping the pods the executor runs, and prometheus-adapter serving
the custom metrics API (`custom.metrics.k8s.io`) that the HorizontalPodAutoscalers read.

- **Scraping.** The executor writes a Prometheus file-discovery file (`scrape/pods.json`) naming, for every pod of
  its that asks to be scraped (`prometheus.io/scrape: "true"`), the loopback port of its `prometheus.io/port` with
  `namespace` and `pod` labels: what Kubernetes service discovery plus relabelling gives on a real cluster, and
  nothing but 127.0.0.1 is ever a target. Other `*.json` files in that folder are scraped too (a test may feed
  series for the simulated GPU pools' pods, labelled with their namespace and pod: labels are honoured).
- **The adapter** runs with the Helm chart's own rules (`charts/tailor/prometheus-adapter-values.yaml`), on
  loopback, with a serving certificate from the devcluster's CA. The API server reaches it through an APIService
  whose Service is of type ExternalName, `localhost`: the aggregator resolves such a Service to that host and the
  Service's port, so the proxied request goes to loopback. It authenticates the API server by the front-proxy CA
  (`--requestheader-*` flags) and each request's user by delegated authorization, as on a real cluster.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import yaml

from tailor.devcluster.pki import ADAPTER_SERVICE, CLIENTS, Pki

CHART_ADAPTER_VALUES = Path(__file__).parents[1] / "charts" / "tailor" / "prometheus-adapter-values.yaml"
SCRAPE_INTERVAL_S = 5
RELIST_INTERVAL_S = 15  # how often the adapter lists the series it serves (at least the scrape interval)
API_GROUP, API_VERSION = "custom.metrics.k8s.io", "v1beta1"
ADAPTER_USER = next(c.user for c in CLIENTS if c.file_stem == "prometheus-adapter")


def scrape_folder(root: Path) -> Path:
    """Where file-discovery target files go (`pods.json` from the executor, others from whoever feeds)."""
    return root / "scrape"


def prometheus_config(root: Path) -> dict[str, Any]:
    """Prometheus's configuration: every target of every file in the scrape folder, labels honoured."""
    return {"global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": [{
                "job_name": "devcluster-pods", "honor_labels": True,
                "file_sd_configs": [{"files": [str(scrape_folder(root) / "*.json")],
                                     "refresh_interval": f"{SCRAPE_INTERVAL_S}s"}]}]}


def adapter_config(values_file: Path = CHART_ADAPTER_VALUES) -> dict[str, Any]:
    """The adapter's configuration: the chart values' custom rules, as the prometheus-adapter chart renders them."""
    values = yaml.safe_load(values_file.read_text())
    rules = (values or {}).get("rules", {}).get("custom")
    if not isinstance(rules, list) or not rules:
        raise ValueError(f"{values_file}: rules.custom: expected a list of prometheus-adapter rules")
    return {"rules": rules}


def prometheus_argv(binary: Path, root: Path, port: int) -> list[str]:
    return [str(binary), f"--config.file={root / 'prometheus.yaml'}", f"--storage.tsdb.path={root / 'prometheus'}",
            "--storage.tsdb.retention.time=6h", f"--web.listen-address=127.0.0.1:{port}"]


def adapter_argv(binary: Path, root: Path, pki: Pki, kubeconfig: Path, port: int, prometheus_port: int) -> list[str]:
    return [str(binary), "--bind-address=127.0.0.1", f"--secure-port={port}",
            f"--tls-cert-file={pki.adapter_serving_cert}", f"--tls-private-key-file={pki.adapter_serving_key}",
            f"--lister-kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", f"--prometheus-url=http://127.0.0.1:{prometheus_port}/",
            f"--metrics-relist-interval={RELIST_INTERVAL_S}s", f"--config={root / 'prometheus-adapter.yaml'}"]


def write_configs(root: Path) -> None:
    """Prometheus's and the adapter's configuration files, and the (empty) scrape folder."""
    scrape_folder(root).mkdir(parents=True, exist_ok=True)
    (root / "prometheus.yaml").write_text(yaml.safe_dump(prometheus_config(root), sort_keys=False))
    (root / "prometheus-adapter.yaml").write_text(yaml.safe_dump(adapter_config(), sort_keys=False))


def manifests(pki: Pki, port: int) -> list[dict[str, Any]]:
    """The adapter's registration (ExternalName Service to loopback, APIService) and its RBAC."""
    name, namespace = ADAPTER_SERVICE
    user = {"kind": "User", "name": ADAPTER_USER, "apiGroup": "rbac.authorization.k8s.io"}
    ca_bundle = base64.b64encode(pki.ca_cert.read_bytes()).decode()
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
         "spec": {"type": "ExternalName", "externalName": "localhost",
                  "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
         "metadata": {"name": f"{API_VERSION}.{API_GROUP}"},
         "spec": {"group": API_GROUP, "version": API_VERSION, "groupPriorityMinimum": 100, "versionPriority": 100,
                  "service": {"name": name, "namespace": namespace, "port": port}, "caBundle": ca_bundle}},
        # delegated authentication and authorization (TokenReview, SubjectAccessReview), as every extension API
        # server needs; the requestheader CA from kube-system's extension-apiserver-authentication ConfigMap
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "tailor:prometheus-adapter:auth-delegator"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:auth-delegator"},
         "subjects": [user]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "tailor:prometheus-adapter:auth-reader", "namespace": "kube-system"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                     "name": "extension-apiserver-authentication-reader"},
         "subjects": [user]},
        # what it maps series to: namespaces and pods (the rules' resources)
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "tailor:prometheus-adapter:resource-reader"},
         "rules": [{"apiGroups": [""], "resources": ["namespaces", "pods", "services", "nodes"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "tailor:prometheus-adapter:resource-reader"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "tailor:prometheus-adapter:resource-reader"},
         "subjects": [user]},
    ]


def scrape_target(namespace: str, name: str, annotations: dict[str, str] | None,
                  ports: dict[str, int]) -> dict[str, Any] | None:
    """A pod's file-discovery entry: its `prometheus.io/port` (a container port number or name) at the loopback
    port the executor gave it, or None when the pod does not ask to be scraped or has no such port."""
    annotations = annotations or {}
    if annotations.get("prometheus.io/scrape") != "true" or (port := annotations.get("prometheus.io/port")) is None:
        return None
    local = ports.get(port)
    if local is None:
        return None
    labels = {"namespace": namespace, "pod": name}
    if path := annotations.get("prometheus.io/path"):
        labels["__metrics_path__"] = path
    return {"targets": [f"127.0.0.1:{local}"], "labels": labels}


def write_targets(path: Path, targets: list[dict[str, Any]]) -> bool:
    """Replace the file-discovery file `path` with `targets` at once (Prometheus never reads half a file);
    False, writing nothing, when it already holds them."""
    text = json.dumps(sorted(targets, key=json.dumps), indent=1)
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.tmp")  # not *.json: Prometheus reads only what matches
    staged.write_text(text)
    staged.replace(path)
    return True
