"""The operator image, built for real (`images/build.py`: buildah on a Debian base made by debootstrap), run
against the devcluster as the chart's Deployment runs it: its command and arguments from the rendered chart, the
chart's ServiceAccount token, CA and namespace at the standard path, the API server from KUBERNETES_SERVICE_HOST
and _PORT, the chart's GPU profiles ConfigMap at /etc/tailor, the chart's user. It runs with `buildah run`
(chroot isolation) since podman cannot run a container on these machines (crun is refused setrlimit), sharing the
host's network, so its listeners are bound to loopback as the executor binds every pod's. kwok plays the GPU
nodes, as in test_operator.py: what is real is the API server, the controllers and the operator in its image."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tailor.devcluster import cluster, images
from tailor.devcluster.executor import free_port, loopback_args
from tailor.devcluster.simulated import published_results

from cmodels import OBJECTS, h100_example, wait_phase
from conftest import CHART, KUBE_VERSION, REPO, SIMULATED_RESULTS, delete_models, wait_for

# where a kubelet mounts the ServiceAccount volume, /var/run/secrets/kubernetes.io/serviceaccount, with the link
# /var/run -> /run that Debian has resolved: buildah's chroot isolation does not follow a link in a mount target
SERVICE_ACCOUNT_MOUNT = "/run/secrets/kubernetes.io/serviceaccount"


@pytest.fixture(scope="session")
def operator_image() -> str:
    """`images/build.py operator` (buildah's layer cache makes a rebuild of unchanged sources quick)."""
    subprocess.run([sys.executable, str(REPO / "images" / "build.py"), "operator"], check=True, timeout=1500)
    report = json.loads((REPO / "build" / "images" / "images.json").read_text())
    return str(next(image["reference"] for image in report if image["name"] == "operator"))


class ImageOperator:
    """The chart's operator container, run from its image until stopped: its command and arguments, with free
    loopback ports for its metrics and liveness, and bound to loopback as the executor binds it."""

    def __init__(self, container: str, spec: dict[str, Any], user: str, mounts: dict[str, Path],
                 env: dict[str, str], log: Path) -> None:
        self.log = log
        self.liveness_port = free_port()
        ports = {"--liveness-port": self.liveness_port, "--metrics-port": free_port()}
        args = [f"{flag}={ports[flag]}" if (flag := arg.split("=", 1)[0]) in ports else arg for arg in spec["args"]]
        self.process = images.start(container, loopback_args([*spec["command"], *args]), log, user, mounts, env)

    def healthz(self) -> bool:
        import urllib.request

        if self.process.poll() is not None:
            raise AssertionError(f"the operator in its image exited with {self.process.returncode}:\n"
                                 f"{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=5) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _rendered(helm: Callable[..., Any], namespace: str) -> dict[str, dict[str, Any]]:
    """The chart for an operator watching `namespace` (release = namespace), by kind."""
    text = helm("template", namespace, str(CHART), "-n", namespace, "--kube-version", KUBE_VERSION,
                "--set", f"tenancy.allowedAnnotationPrefixes={{{SIMULATED_RESULTS}}}").stdout
    return {doc["kind"]: doc for doc in yaml.safe_load_all(text) if doc and doc["kind"] in ("Deployment",
                                                                                             "ConfigMap")}


def _shared_folder(files: dict[str, str]) -> Path:
    """A folder other users may read (the container runs as the chart's user, not root), holding `files`."""
    folder = Path(tempfile.mkdtemp(prefix="tailor-image-test-"))
    folder.chmod(0o755)
    for name, text in files.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o644)
    return folder


@pytest.fixture
def image_operator(operator_image: str, devcluster: cluster.Layout, crd: None, api: client.ApiClient,
                   helm: Callable[..., Any], namespace: str, chart_rbac: str,
                   tmp_path: Path) -> Iterator[ImageOperator]:
    chart = _rendered(helm, namespace)
    pod = chart["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    token = client.CoreV1Api(api).create_namespaced_service_account_token(
        chart_rbac, namespace, {"spec": {"expirationSeconds": 3600}}).status.token
    server = yaml.safe_load(devcluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    host, port = server.removeprefix("https://").rsplit(":", 1)
    account = _shared_folder({"token": token, "namespace": namespace,
                              "ca.crt": client.CoreV1Api(api).read_namespaced_config_map(
                                  "kube-root-ca.crt", namespace).data["ca.crt"]})
    profiles = _shared_folder(chart["ConfigMap"]["data"])
    scratch = _shared_folder({})
    scratch.chmod(0o1777)
    mounts = {SERVICE_ACCOUNT_MOUNT: account, "/tmp": scratch,
              **{m["mountPath"]: profiles for m in container["volumeMounts"] if m["name"] == "gpu-profiles"}}
    user = f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    with images.working_container(operator_image) as name:
        running = ImageOperator(name, container, user, mounts,
                                {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port},
                                tmp_path / "operator.log")
        try:
            wait_for("the operator in its image to answer /healthz", running.healthz, 120)
            yield running
            delete_models(api, namespace)
        finally:
            images.stop(running.process)
            for folder in (account, profiles, scratch):
                shutil.rmtree(folder)


@pytest.mark.timeout(1800)  # a cold image build: debootstrap, then the wheels installed into it
def test_the_operator_image_runs_a_compressed_model_to_ready(api: client.ApiClient, namespace: str,
                                                             image_operator: ImageOperator) -> None:
    objects = client.CustomObjectsApi(api)
    OBJECTS.create(objects, namespace, h100_example("super", published_results()))
    ready = wait_phase(objects, namespace, "super", "Ready", image_operator)
    assert {c["type"]: c["status"] for c in ready["status"]["conditions"]}["Ready"] == "True"
    assert client.AppsV1Api(api).read_namespaced_deployment("super-h100-g1", namespace).status.ready_replicas


def test_the_operator_image_is_small_runs_as_its_user_and_has_no_torch(operator_image: str) -> None:
    config = json.loads(subprocess.run(["buildah", "inspect", "--type", "image", operator_image], check=True,
                                       text=True, capture_output=True).stdout)["OCIv1"]["config"]
    assert config["User"] == "65532:65532" and config["Entrypoint"] == ["tailor"]
    size = images.image_bytes(operator_image)
    assert size < 400e6, f"the operator image is {size / 1e6:.0f} MB"
    with images.working_container(operator_image) as container:
        found = images.run(container, ["python", "-c", "import importlib.util as u; print([m for m in ('torch', "
                                                       "'modelopt', 'vllm') if u.find_spec(m)])"])
        assert found.stdout.strip() == "[]", found.stderr
        user = images.run(container, ["python", "-c", "import getpass; print(getpass.getuser())"], "65532:65532")
        assert user.stdout.strip() == "tailor", user.stderr  # kopf names the operator after its user
        assert "operator" in images.run(container, ["tailor", "--help"]).stdout
