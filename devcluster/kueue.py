"""Kueue on the devcluster: the real controller (`sigs.k8s.io/kueue`'s manager, built from its Go module with its
CRDs), so that stage Jobs are queued and admitted as on a platform team's cluster (`tailor devcluster up --kueue`).

Kueue's manager runs webhooks and manages their certificates itself, and waits until it has put its CA into every
webhook configuration and CRD conversion hook it knows, and until its certificate is mounted, before starting its
controllers. The devcluster mounts the certificate as a kubelet would (`mount_certificate`) and gives it those
objects without anything for the API server to call: both webhook configurations are empty (Jobs are created
suspended and labelled by Tailor itself, which is all Kueue's Job webhook would add), and the CRDs' conversion hooks
name a Service no request reaches, as long as clients use the storage version (v1beta2), which Kueue, Tailor and
kubectl do. What is left is Kueue's scheduler and Job integration: quota, admission, unsuspending.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

NAMESPACE = "kueue-system"
API_VERSION = "kueue.x-k8s.io/v1beta2"
WEBHOOK_SERVICE = "kueue-webhook-service"  # Kueue's default names, which its certificate manager looks for
WEBHOOK_SECRET = "kueue-webhook-server-cert"
CONVERTED_CRDS = ("localqueues", "clusterqueues", "workloads", "cohorts", "multikueueclusters")


def crds(crd_folder: Path) -> list[dict[str, Any]]:
    """Kueue's CRDs as its release installs them: those with a conversion hook get one, pointing at Kueue's
    webhook Service."""
    objects = [yaml.safe_load(path.read_text()) for path in sorted(crd_folder.glob("*.yaml"))]
    for crd in objects:
        if crd["metadata"]["name"].split(".", 1)[0] in CONVERTED_CRDS:
            crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                "conversionReviewVersions": ["v1"],
                "clientConfig": {"service": {"name": WEBHOOK_SERVICE, "namespace": NAMESPACE, "path": "/convert"}}}}
    return objects


def manifests() -> list[dict[str, Any]]:
    """Kueue's namespace, the Secret its certificate manager fills, and its two webhook configurations, empty."""
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": WEBHOOK_SECRET, "namespace": NAMESPACE}},
        *({"apiVersion": "admissionregistration.k8s.io/v1", "kind": f"{kind}WebhookConfiguration",
           "metadata": {"name": f"kueue-{kind.lower()}-webhook-configuration"}, "webhooks": []}
          for kind in ("Validating", "Mutating")),
    ]


def write_config(root: Path, health_port: int, webhook_port: int) -> Path:
    """The manager's Configuration: loopback ports, no leader election, no metrics server, batch/v1 Jobs only."""
    path = root / "kueue-config.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir(root))},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True, "webhookServiceName": WEBHOOK_SERVICE,
                                   "webhookSecretName": WEBHOOK_SECRET},
        "integrations": {"frameworks": ["batch/job"]},
    }))
    return path


def cert_dir(root: Path) -> Path:
    return root / "kueue-certs"


def mount_certificate(secret: dict[str, Any], root: Path) -> bool:
    """Write the serving certificate Kueue put in its Secret into its cert folder, as the kubelet projects a Secret
    volume into Kueue's pod (Kueue waits for the files before it starts its controllers); False until it is there."""
    data = secret.get("data") or {}
    if not all(data.get(name) for name in ("tls.crt", "tls.key")):
        return False
    folder = cert_dir(root)
    folder.mkdir(mode=0o700, exist_ok=True)
    for name in ("tls.key", "tls.crt"):  # the key first: Kueue looks for the certificate
        partial = folder / f".{name}.partial"
        partial.write_bytes(base64.b64decode(data[name]))
        partial.rename(folder / name)
    return True


def argv(binary: Path, config: Path, kubeconfig: Path) -> list[str]:
    return [str(binary), f"--config={config}", f"--kubeconfig={kubeconfig}"]
