"""kubectl and helm built beside the control plane work against it, at the same Kubernetes version."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tailor.devcluster import build, cluster

CHART_YAML = """apiVersion: v2
name: probe
version: 0.1.0
kubeVersion: ">=1.33.0-0"
"""
CONFIGMAP = """apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-capabilities
data:
  kubeVersion: {{ .Capabilities.KubeVersion.Version | quote }}
"""


def test_kubectl_client_and_server_versions_match(kubectl: Callable[..., Any]) -> None:
    versions = json.loads(kubectl("version", "-o", "json").stdout)
    assert versions["clientVersion"]["gitVersion"] == versions["serverVersion"]["gitVersion"]
    assert versions["serverVersion"]["gitVersion"] == build.kubernetes_version()


def test_helm_installs_a_chart_that_checks_kube_version(devcluster: cluster.Layout, namespace: str,
                                                       kubectl: Callable[..., Any], tmp_path: Path) -> None:
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(CHART_YAML)
    (chart / "templates" / "configmap.yaml").write_text(CONFIGMAP)
    helm = build.ensure_binaries() / "helm"
    subprocess.run([str(helm), "install", "probe", str(chart), f"--namespace={namespace}", "--wait",
                    f"--kubeconfig={devcluster.kubeconfig}"], check=True, capture_output=True, timeout=120)
    rendered = kubectl("get", "configmap", "probe-capabilities", f"--namespace={namespace}",
                       "-o", "jsonpath={.data.kubeVersion}").stdout
    assert rendered == build.kubernetes_version()
