"""The Helm chart against the devcluster: lint, templates validated by the API server (server-side dry run),
values checked by the schema, install / test / upgrade / uninstall, and what the operator's ServiceAccount may
and may not do. The operator lifecycle under exactly these permissions is test_operator_local.py (the chart's
pod) and test_operator.py (an operator process with the chart's ServiceAccount token)."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tailor.devcluster import build, cluster
from tailor.devcluster.executor import free_port
from tailor.operator.names import FINALIZER

from cmodels import OBJECTS, cmodel, h100_example
from conftest import CHART, DEVCLUSTER_VALUES, KUBE_VERSION, InstalledOperator, wait_for

# Every option away from its default: cluster-wide RBAC, NetworkPolicy, monitoring, profiles, pull secrets.
CUSTOM = {
    "clusterWide": True,
    "image": {"repository": "registry.example.com/tailor-operator", "tag": "0.1.0-rc1", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "registry"}],
    "jobs": {"image": "registry.example.com/tailor-runtime:0.1.0-rc1", "serviceAccountName": "compress-jobs",
             "claimSize": "500Gi", "imagePullSecrets": [{"name": "registry"}]},
    "serving": {"serviceAccountName": "triton", "countHeldGpus": False},
    "gpuProfiles": [{"name": "H100-80GB", "gfdProducts": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-SXM5-80GB"]}],
    "serviceAccount": {"name": "tailor-operator", "annotations": {"example.com/role": "operator"}},
    "operator": {"logLevel": "debug", "nodeSelector": {"kubernetes.io/os": "linux"},
                 "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system",
                                  "effect": "NoSchedule"}],
                 "priorityClassName": "system-cluster-critical", "podAnnotations": {"example.com/a": "b"}},
    "networkPolicy": {"enabled": False, "apiServer": {"cidrs": ["10.0.0.1/32"], "ports": [6443]}},
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                   "tritonPodMonitor": {"enabled": True}},
}
# The Prometheus Operator's two kinds, reduced to schemas that keep every field: enough for the API server to
# accept the chart's ServiceMonitor and PodMonitor in a dry run (no Prometheus Operator runs here).
MODELS = "compressedmodels.tailor.dev"
MONITORING_KINDS = [("ServiceMonitor", "servicemonitors"), ("PodMonitor", "podmonitors")]


def _monitoring_crd(kind: str, plural: str) -> dict[str, Any]:
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.monitoring.coreos.com"},
            "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


@pytest.fixture(scope="module")
def monitoring_crds(kubectl: Callable[..., Any]) -> None:
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([_monitoring_crd(*kind) for kind in MONITORING_KINDS]))
    for _, plural in MONITORING_KINDS:
        kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{plural}.monitoring.coreos.com")


def _values(tmp_path: Path, values: dict[str, Any]) -> Path:
    path = tmp_path / f"values-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_lint(helm: Callable[..., Any], tmp_path: Path) -> None:
    for extra in ([], ["-f", str(_values(tmp_path, CUSTOM))], ["-f", str(DEVCLUSTER_VALUES)]):
        result = helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *extra)
        assert "0 chart(s) failed" in result.stdout


NETWORK = {"networkPolicy": {"monitoringNamespaces": ["prometheus"], "clientNamespaces": ["gateway"],
                             "clientCidrs": ["10.20.0.0/16"], "metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
                             "apiServer": {"cidrs": ["10.0.0.1/32"], "ports": [6443]}}}


@pytest.mark.parametrize("values", [{}, CUSTOM, {"watchNamespaces": ["team-a", "team-b"],
                                                "serving": {"heldGpuNamespaces": ["gpu-a"]}}, NETWORK],
                         ids=["default", "custom", "two-namespaces", "network"])
def test_templates_pass_a_server_side_dry_run(helm: Callable[..., Any], kubectl: Callable[..., Any],
                                              monitoring_crds: None, namespace: str, values: dict[str, Any],
                                              tmp_path: Path) -> None:
    for watched in [*values.get("watchNamespaces", []), *values.get("serving", {}).get("heldGpuNamespaces", [])]:
        kubectl("create", "namespace", watched, check=False)  # a Role lives in each watched namespace
    rendered = helm("template", "t", str(CHART), "-n", namespace, "--kube-version", KUBE_VERSION,
                    "-f", str(_values(tmp_path, values))).stdout
    kinds = [doc["kind"] for doc in yaml.safe_load_all(rendered) if doc]
    kubectl("create", "serviceaccount", "t-tailor-test", "-n", namespace)  # admission of the test pod looks it up
    result = kubectl("apply", "--dry-run=server", "-f", "-", stdin=rendered)
    assert result.stdout.count("(server dry run)") == len(kinds)
    deployment = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    if values is CUSTOM:  # no NetworkPolicy for the operator, none made for the Triton pods
        assert {"ClusterRole", "ServiceMonitor", "PodMonitor"} <= set(kinds) and "NetworkPolicy" not in kinds
        assert "--no-ingress-policy" in args
        assert kinds.count("Role") == 2  # cluster-wide: only the helm test pod's and the uninstall hook's
        assert "--all-namespaces" in args and "--image-pull-secret=registry" in args and "--verbose" in args
        assert "--job-service-account=compress-jobs" in args and "--serving-service-account=triton" in args
        node_reader = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ClusterRole"
                           and d["metadata"]["name"].endswith("-nodes"))
        assert [rule["resources"] for rule in node_reader["rules"]] == [["nodes"]]  # no pods: countHeldGpus off
    elif values is NETWORK:
        (policy,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "NetworkPolicy"]
        assert policy["spec"]["ingress"][0]["from"][1:] == [{"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["prometheus"]}]}},
            {"ipBlock": {"cidr": "10.0.0.0/8"}}]
        assert policy["spec"]["egress"][0]["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
        assert {"--monitoring-namespace=prometheus", "--client-namespace=gateway", "--client-cidr=10.20.0.0/16"} <= set(
            args)
    elif values:
        roles = [d["metadata"]["namespace"] for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Role"]
        # the helm test's Role and the operator's; the uninstall hook's, in the release namespace and where models
        # are; one that lists pods, only there, where the GPU nodes' other workloads run
        assert sorted(roles) == sorted([namespace, "team-a", "team-b"] * 2 + ["gpu-a"])
        gpu_pods = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Role"
                        and d["metadata"]["namespace"] == "gpu-a")
        assert gpu_pods["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
        node_reader = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ClusterRole")
        assert [rule["resources"] for rule in node_reader["rules"]] == [["nodes"]]  # pods: not cluster-wide
        assert "--gpu-namespace=gpu-a" in args
    else:
        assert kinds.count("Role") == 4  # the operator's, the helm test's, and the uninstall hook's two
        # by default the operator's metrics answer only its namespace and the monitoring stack (the old chart
        # made no NetworkPolicy: any pod could scrape them), and the Triton pods get one too
        (policy,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "NetworkPolicy"]
        assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {}}, {"namespaceSelector": {
            "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}]}}]
        assert "--monitoring-namespace=monitoring" in args and "--no-ingress-policy" not in args


@pytest.mark.parametrize("minor", range(29, int(KUBE_VERSION.split(".")[1]) + 1))
def test_the_chart_renders_on_every_kubernetes_minor_it_claims(helm: Callable[..., Any], minor: int) -> None:
    """Chart.yaml claims 1.29 and later: each minor renders, with the ValidatingAdmissionPolicy only where
    admissionregistration.k8s.io/v1 serves it (1.30+); 1.28 is refused by the chart's kubeVersion."""
    rendered = helm("template", "t", str(CHART), "--kube-version", f"1.{minor}.0").stdout
    kinds = {doc["kind"] for doc in yaml.safe_load_all(rendered) if doc}
    assert {"Deployment", "ClusterRole", "ServiceAccount"} <= kinds
    assert ("ValidatingAdmissionPolicy" in kinds) == (minor >= 30)
    if minor == 29:
        refused = helm("template", "t", str(CHART), "--kube-version", "1.28.0", check=False)
        assert refused.returncode != 0 and "kubeVersion: >=1.29.0-0" in refused.stderr


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    """A real OCI registry (CNCF distribution, built from its Go module) on loopback, storing in `tmp_path`; its
    host:port."""
    binary = build.ensure_registry_binaries() / "registry"
    port = free_port()
    config = tmp_path / "registry.yaml"
    config.write_text(yaml.safe_dump({"version": 0.1, "log": {"level": "warn"},
                                      "storage": {"filesystem": {"rootdirectory": str(tmp_path / "blobs")}},
                                      "http": {"addr": f"127.0.0.1:{port}"}}))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "OTEL_TRACES_EXPORTER": "none",
           "OTEL_SDK_DISABLED": "true"}
    with (tmp_path / "registry.log").open("w") as log:
        process = subprocess.Popen([str(binary), "serve", str(config)], stdout=log, stderr=log, env=env)
        try:
            wait_for("the registry to serve /v2/", lambda: _answers(f"http://127.0.0.1:{port}/v2/"), timeout_s=30)
            yield f"127.0.0.1:{port}"
        finally:
            process.terminate()
            process.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def test_the_chart_is_published_as_an_oci_artifact_and_installs_from_there(
        helm: Callable[..., Any], registry: str, tmp_path: Path) -> None:
    """`make chart`'s steps, `helm package` and `helm push`, to a real registry: the chart pulled back by its OCI
    reference is the one packaged (same digest), and renders as the chart folder does."""
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    helm("package", str(CHART), "--destination", str(tmp_path / "packaged"))
    packaged = tmp_path / "packaged" / f"tailor-{version}.tgz"
    pushed = helm("push", str(packaged), f"oci://{registry}/charts", "--plain-http")
    reference = f"oci://{registry}/charts/tailor"
    assert f"Pushed: {registry}/charts/tailor:{version}" in pushed.stdout + pushed.stderr
    (tmp_path / "pulled").mkdir()
    helm("pull", reference, "--version", version, "--plain-http", "--destination", str(tmp_path / "pulled"))
    assert (tmp_path / "pulled" / packaged.name).read_bytes() == packaged.read_bytes()
    assert yaml.safe_load(helm("show", "chart", reference, "--version", version, "--plain-http").stdout)[
        "version"] == version
    kube = ("--kube-version", KUBE_VERSION.lstrip("v"))
    from_registry = helm("template", "t", reference, "--version", version, "--plain-http", *kube).stdout
    assert from_registry == helm("template", "t", str(CHART), *kube).stdout


@pytest.mark.parametrize(("values", "message"), [
    ({"operator": {"logLevel": "loud"}}, "logLevel"),
    ({"jobs": {"claimSize": "lots"}}, "claimSize"),
    ({"replicas": 2}, "replicas"),
    ({"clusterWide": True, "watchNamespaces": ["a"]}, "set either clusterWide: true or watchNamespaces"),
])
def test_bad_values_are_refused_naming_the_field(helm: Callable[..., Any], tmp_path: Path,
                                                 values: dict[str, Any], message: str) -> None:
    result = helm("template", "t", str(CHART), "--kube-version", KUBE_VERSION, "-f", str(_values(tmp_path, values)),
                  check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def _can(kubectl: Callable[..., Any], account: str, verb: str, resource: str, namespace: str | None) -> bool:
    scope = ["-n", namespace] if namespace else []
    result = kubectl("auth", "can-i", verb, resource, *scope, f"--as={account}", check=False)
    return result.stdout.strip() == "yes"


def test_install_test_upgrade_uninstall_and_permissions(
        api: client.ApiClient, devcluster: cluster.Layout, helm: Callable[..., Any], kubectl: Callable[..., Any],
        crd: None, namespace: str, tmp_path: Path) -> None:
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    release = namespace
    installed = helm("install", release, str(CHART), "-n", namespace, "-f", str(DEVCLUSTER_VALUES), "--wait",
                     "--timeout", "120s").stdout
    assert f"kubectl apply -n {namespace} -f examples/" in installed  # NOTES name a namespace the release watches
    operator = InstalledOperator(devcluster, namespace, release)
    assert "Phase:          Succeeded" in helm("test", release, "-n", namespace, "--timeout", "120s").stdout

    account = f"system:serviceaccount:{namespace}:{release}-tailor"
    other = f"other-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": other}})
    try:
        # granted: what the lifecycle uses, in the watched namespace
        for verb, resource in [("patch", f"{MODELS}"), ("patch", f"{MODELS}/status"), ("create", "jobs.batch"),
                               ("watch", "deployments.apps"), ("create", "serviceaccounts"),
                               ("delete", "persistentvolumeclaims"), ("create", "events"),
                               *[("watch", kind) for kind in ("configmaps", "services", "pods", "jobs.batch",
                                                              "persistentvolumeclaims", MODELS)]]:
            assert _can(kubectl, account, verb, resource, namespace), f"{verb} {resource} should be granted"
        assert _can(kubectl, account, "list", "nodes", None)
        assert _can(kubectl, account, "list", "pods", None)  # the GPUs other pods hold (serving.countHeldGpus)
        # not granted: what it never needs
        for verb, resource, where in [
                ("get", "secrets", namespace), ("list", "secrets", namespace), ("create", "pods/exec", namespace),
                ("create", MODELS, namespace), ("delete", MODELS, namespace),
                ("update", "deployments.apps", namespace), ("patch", "jobs.batch", namespace),
                ("create", "pods", namespace), ("patch", "nodes", None), ("get", "customresourcedefinitions", None),
                ("create", "rolebindings.rbac.authorization.k8s.io", namespace),
                ("create", "jobs.batch", other), ("list", MODELS, other), ("get", "pods", other),
                ("watch", "pods", other), ("watch", "configmaps", other),
                ("get", "pods/log", other)]:
            assert not _can(kubectl, account, verb, resource, where), f"{verb} {resource} in {where} is granted"
    finally:
        core.delete_namespace(other)

    # upgrade: a new GPU profile reaches the operator (the checksum rolls its pod)
    operator_pods = "app.kubernetes.io/component=operator"
    before = {p.metadata.uid for p in core.list_namespaced_pod(namespace, label_selector=operator_pods).items}
    profiles = {"gpuProfiles": [{"name": "cpu", "gfdProducts": ["tailor-local-cpu", "tailor-other-cpu"]}]}
    helm("upgrade", release, str(CHART), "-n", namespace, "-f", str(DEVCLUSTER_VALUES), "-f",
         str(_values(tmp_path, profiles)), "--wait", "--timeout", "120s")
    pods = core.list_namespaced_pod(namespace, label_selector=operator_pods).items
    assert {p.metadata.uid for p in pods}.isdisjoint(before)
    config_map = core.read_namespaced_config_map(f"{release}-tailor-gpu-profiles", namespace)
    assert yaml.safe_load(config_map.data["profiles.yaml"]) == {"profiles": profiles["gpuProfiles"]}
    assert apps.read_namespaced_deployment(f"{release}-tailor", namespace).status.available_replicas == 1
    assert "Phase:          Succeeded" in helm("test", release, "-n", namespace, "--timeout", "120s").stdout, \
        operator.log_tail()

    # a CompressedModel the operator holds with its finalizer ...
    objects = client.CustomObjectsApi(api)
    OBJECTS.create(objects, namespace, h100_example("kept", {}))
    wait_for("the operator's finalizer", lambda: FINALIZER in ((cmodel(objects, namespace, "kept") or {}).get(
        "metadata", {}).get("finalizers") or []), timeout_s=60)

    helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "180s")
    wait_for("the operator's pods to go", lambda: not core.list_namespaced_pod(
        namespace, label_selector=operator_pods).items, timeout_s=60)
    # ... is released by the pre-delete hook: it stays, and deleting it no longer waits for an operator that is
    # gone (the old chart left the finalizer: the delete hung forever); the hook's objects are gone too
    kept = cmodel(objects, namespace, "kept")
    assert kept is not None and FINALIZER not in (kept["metadata"].get("finalizers") or [])
    OBJECTS.delete(objects, namespace, "kept")
    wait_for("the released object to go", lambda: cmodel(objects, namespace, "kept") is None, timeout_s=30)
    assert not [j for j in client.BatchV1Api(api).list_namespaced_job(namespace).items
                if j.metadata.name.endswith("-release")]
    rbac = client.RbacAuthorizationV1Api(api)
    assert not [r for r in rbac.list_cluster_role().items if r.metadata.name.startswith(f"{release}-tailor")]
    assert not rbac.list_namespaced_role(namespace).items
    assert not [a for a in core.list_namespaced_service_account(namespace).items  # the chart's: the operator's
                if (a.metadata.labels or {}).get("app.kubernetes.io/managed-by") == "Helm"]  # own (tailor-job) stay
    # Helm leaves a chart's CRDs (and so every CompressedModel) in place
    client.ApiextensionsV1Api(api).read_custom_resource_definition("compressedmodels.tailor.dev")



POOL = {"name": "h100", "nodeSelector": {"a": "b"}, "concurrency": {"perNode": 8}}


@pytest.mark.parametrize(("change", "says"), [
    ({"jobs": {"image": "docker.io/attacker/miner:1"}}, "spec.jobs.image is not an allowed image"),
    ({"jobs": {"image": "tailor-runtime:dev-evil"}}, "spec.jobs.image"),  # the job image is exact, not a prefix
    ({"deployment": {"tritonImage": "ghcr.io/tailor-dev.evil.example/triton:1"}}, "spec.deployment.tritonImage"),
    ({"jobs": {"podAnnotations": {"sidecar.istio.io/inject": "true"}}}, "podAnnotations: keys must start"),
    ({"deployment": {"pools": [{**POOL, "podAnnotations": {"sidecar.istio.io/inject": "true"}}]}},
     "podAnnotations: keys must start"),
    ({"jobs": {"priorityClassName": "system-node-critical"}}, "tenancy.allowedPriorityClasses: none"),
    ({"deployment": {"pools": [{**POOL, "priorityClassName": "gpu-batch"}]}}, "tenancy.allowedPriorityClasses: none"),
    ({"jobs": {"podLabels": {"app": "web"}}}, "tenancy.allowedPodLabelPrefixes: none"),  # another Service's pods
    ({"deployment": {"pools": [{**POOL, "podLabels": {"sidecar.istio.io/inject": "true"}}]}},
     "tenancy.allowedPodLabelPrefixes: none"),
    ({"jobs": {"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]}},
     "tenancy.allowedTolerationKeys: cloud.google.com/gke-spot"),
    ({"deployment": {"pools": [{**POOL, "resources": {"limits": {"devices.kubevirt.io/kvm": "1"}}}]}},
     "tenancy.allowedExtendedResources: vpc.amazonaws.com/efa, rdma/ib"),
], ids=["foreign-image", "job-image-as-prefix", "lookalike-registry", "annotation", "pool-annotation",
        "system-priority", "pool-priority", "label", "pool-label", "control-plane-toleration", "pool-kvm"])
def test_the_admission_policy_refuses_what_a_tenant_may_not_ask_for(
        api: client.ApiClient, namespace: str, installed_operator: InstalledOperator, change: dict[str, Any],
        says: str) -> None:
    """The chart's ValidatingAdmissionPolicy, on the real API server: on create, and on an update of an object
    that was let in."""
    from kubernetes.client.exceptions import ApiException

    from corpus import patched

    objects = client.CustomObjectsApi(api)

    def refused(body_or_patch: dict[str, Any], name: str | None = None) -> str:
        try:
            if name is None:
                OBJECTS.create(objects, namespace, body_or_patch)
            else:
                OBJECTS.patch(objects, namespace, name, body_or_patch)
        except ApiException as error:
            return str(error.body)
        return ""

    message = wait_for("the policy to refuse the object", lambda: refused(
        patched({"metadata": {"name": "tenant"}, "spec": change})), timeout_s=30)
    assert says in message and "ValidatingAdmissionPolicy" in message, message
    assert refused(patched({"metadata": {"name": "tenant"}})) == ""
    assert says in refused({"spec": change}, name="tenant")


def test_tenants_get_compressedmodels_through_edit_and_view_but_never_the_status(
        api: client.ApiClient, namespace: str, installed_operator: InstalledOperator, kubectl: Callable[..., Any]
) -> None:
    """The chart's tenant ClusterRoles, aggregated by the cluster's own controller into edit and view: an editor
    creates and deletes CompressedModels, a viewer reads them, and neither may write their status."""
    for who, role in (("editor", "edit"), ("viewer", "view")):
        kubectl("create", "serviceaccount", who, "-n", namespace)
        kubectl("create", "rolebinding", who, f"--clusterrole={role}", f"--serviceaccount={namespace}:{who}",
                "-n", namespace)

    def can(who: str, verb: str, resource: str, subresource: str = "") -> bool:
        answer = kubectl("auth", "can-i", verb, resource, f"--subresource={subresource}", "-n", namespace,
                         f"--as=system:serviceaccount:{namespace}:{who}", check=False)
        return answer.stdout.strip() == "yes"

    wait_for("edit to aggregate the chart's rules", lambda: can("editor", "create", MODELS), timeout_s=60)
    wait_for("view to aggregate the chart's rules", lambda: can("viewer", "list", MODELS), timeout_s=60)
    assert can("editor", "delete", MODELS) and can("editor", "patch", MODELS)
    assert not can("viewer", "create", MODELS)
    for who in ("editor", "viewer"):
        assert not can(who, "patch", MODELS, "status") and not can(who, "update", MODELS, "status")


def test_only_the_operator_writes_tailor_annotations(api: client.ApiClient, namespace: str,
                                                     installed_operator: InstalledOperator,
                                                     kubectl: Callable[..., Any]) -> None:
    """kopf keeps the operator's progress in tailor.dev/ annotations: a tenant (edit in the namespace) who writes
    one, on create or later, is refused by the admission policy; their own annotations are theirs."""
    from corpus import patched

    kubectl("create", "serviceaccount", "tenant", "-n", namespace)
    kubectl("create", "rolebinding", "tenant", "--clusterrole=edit", f"--serviceaccount={namespace}:tenant",
            "-n", namespace)
    tenant = ["-n", namespace, f"--as=system:serviceaccount:{namespace}:tenant"]
    forged = patched({"metadata": {"name": "forged", "annotations": {"tailor.dev/handler.x": "{}"}}})
    body = json.dumps({"apiVersion": "tailor.dev/v1alpha1", "kind": "CompressedModel", **forged})
    refused = wait_for("the tenant role and the policy", lambda: (
        answer := kubectl("create", "-f", "-", *tenant, stdin=body, check=False)).returncode != 0
        and "tailor.dev/ are the operator's" in answer.stderr and answer, timeout_s=60)
    assert "ValidatingAdmissionPolicy" in refused.stderr
    own = json.dumps({"apiVersion": "tailor.dev/v1alpha1", "kind": "CompressedModel",
                      **patched({"metadata": {"name": "own", "annotations": {"team.example.com/owner": "ml"}}})})
    kubectl("create", "-f", "-", *tenant, stdin=own)
    later = kubectl("annotate", "compressedmodels", "own", "tailor.dev/handler.x={}", *tenant, check=False)
    assert later.returncode != 0 and "tailor.dev/ are the operator's" in later.stderr
    kubectl("annotate", "compressedmodels", "own", "team.example.com/owner=research", "--overwrite", *tenant)
