"""How the operator authenticates: in a pod, with its ServiceAccount's token; elsewhere, with the kubeconfig.

In a pod the token, the cluster's CA and the namespace are files under the standard mount path. The
devcluster's executor runs pods as local processes and cannot mount anything there, so it names the folder
it wrote them to in `TAILOR_SERVICE_ACCOUNT_DIR`. The kubernetes client (the reconciler's) and kopf (its
watches) get the same credentials; a token the kubelet rotates is re-read by both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import kopf
from kubernetes import client, config

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def service_account_dir() -> Path:
    return Path(os.environ.get("TAILOR_SERVICE_ACCOUNT_DIR", SERVICE_ACCOUNT_DIR))


def load_config() -> client.Configuration:
    """The in-cluster configuration when running in a pod, else the current kubeconfig context."""
    folder = service_account_dir()
    if os.environ.get("KUBERNETES_SERVICE_HOST") and (folder / "token").exists():
        loader = config.incluster_config.InClusterConfigLoader(  # type: ignore[no-untyped-call]
            token_filename=str(folder / "token"), cert_filename=str(folder / "ca.crt"), try_refresh_token=True)
        loader.load_and_set()  # type: ignore[no-untyped-call]
    else:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.Configuration.get_default_copy()


def connection(settings: client.Configuration) -> kopf.ConnectionInfo:
    """kopf's view of the same credentials: a bearer token, or the kubeconfig's client certificate."""
    header = settings.get_api_key_with_prefix("BearerToken") or settings.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    namespace_file = service_account_dir() / "namespace"
    return kopf.ConnectionInfo(
        server=settings.host, ca_path=settings.ssl_ca_cert, insecure=not settings.verify_ssl,
        scheme=scheme or None, token=token or None, certificate_path=settings.cert_file,
        private_key_path=settings.key_file,
        default_namespace=namespace_file.read_text().strip() if token and namespace_file.exists() else None)


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    return connection(load_config())
