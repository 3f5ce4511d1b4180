"""The devcluster's inputs without starting it: node pools, certificates, build pins, metrics configuration."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from tailor.compressor.compute import NFD_CPUID, nfd_labels
from tailor.devcluster import build, executor, metrics, nodes, pki


def test_default_pools_match_the_documented_fleet() -> None:
    pools = {pool.name: pool for pool in nodes.load_pools().pools}
    fleet = {name: (pool.count, pool.gpu.count if pool.gpu else 0) for name, pool in pools.items()}
    assert fleet == {"h100": (2, 8), "b200": (1, 8), "a100": (2, 4), "l40s": (1, 2), "gke-h100": (1, 8),
                     "eks-h200": (1, 8), "h100-sxm5": (1, 8), "a100-mig": (1, 28), "cpu": (2, 0), "local": (1, 2)}
    assert [name for name, pool in pools.items() if pool.executor] == ["local"]


def test_gpu_nodes_carry_capacity_labels_and_taint() -> None:
    manifests = {m["metadata"]["name"]: m for m in nodes.node_manifests(nodes.load_pools())}
    h100 = manifests["h100-1"]
    assert h100["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert h100["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert h100["metadata"]["labels"]["nvidia.com/gpu.family"] == "hopper"
    assert h100["metadata"]["annotations"] == {nodes.KWOK_ANNOTATION: "fake"}
    assert h100["spec"]["taints"] == [nodes.GPU_TAINT]
    assert "nvidia.com/gpu" not in manifests["cpu-0"]["status"]["capacity"]
    assert manifests["cpu-0"]["spec"]["taints"] == []
    gke = manifests["gke-h100-0"]  # as GKE labels a node with no GPU Operator: no GFD label at all
    assert gke["metadata"]["labels"]["cloud.google.com/gke-accelerator"] == "nvidia-h100-80gb"
    assert not any(key.startswith("nvidia.com/") for key in gke["metadata"]["labels"])
    assert gke["status"]["allocatable"]["nvidia.com/gpu"] == "8" and gke["spec"]["taints"] == [nodes.GPU_TAINT]
    local = manifests["local-0"]["metadata"]  # run by the executor, not kwok
    assert local["annotations"] == {} and local["labels"][nodes.EXECUTOR_LABEL] == "true"


def test_the_executor_node_carries_the_cpuid_labels_nfd_gives_this_cpu(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from /proc/cpuinfo as NFD reads CPUID; `ATEN_CPU_CAPABILITY=avx2` makes it a CPU without AVX-512, as
    torch then acts; kwok's nodes get none (they run nothing)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert nodes.host_cpu_flags(cpuinfo) >= {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert nodes.host_cpu_flags(cpuinfo) == {"fpu", "avx", "avx2"}
    assert nodes.host_cpu_flags(tmp_path / "missing") == set()
    manifests = {m["metadata"]["name"]: m["metadata"]["labels"] for m in nodes.node_manifests(nodes.load_pools())}
    assert not any(key.startswith(NFD_CPUID) for key in manifests["h100-0"])
    assert {key for key in manifests["local-0"] if key.startswith(NFD_CPUID)} == set(
        nfd_labels(nodes.host_cpu_flags()))


def test_bad_pools_file_names_the_file_and_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "pools.yaml"
    bad.write_text("pools:\n  - name: h100\n    count: 0\n    cpu: '8'\n    memory: 1Gi\n")
    expected = r"pools\.yaml: invalid node pools: pools\.0\.count: Input should be greater than 0"
    with pytest.raises(ValueError, match=expected):
        nodes.load_pools(bad)


def test_certificates_chain_to_the_ca_with_kubeadm_identities(tmp_path: Path) -> None:
    created = pki.ensure_pki(tmp_path / "pki")
    ca = x509.load_pem_x509_certificate(created.ca_cert.read_bytes())
    admin = x509.load_pem_x509_certificate(created.client_cert("admin").read_bytes())
    admin.verify_directly_issued_by(ca)
    assert admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    scheduler = x509.load_pem_x509_certificate(created.client_cert("scheduler").read_bytes())
    assert scheduler.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:kube-scheduler"
    serving = x509.load_pem_x509_certificate(created.serving_cert.read_bytes())
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "kubernetes.default.svc" in names.get_values_for_type(x509.DNSName)
    assert oct(created.ca_key.stat().st_mode & 0o777) == "0o600"
    before = created.ca_cert.read_bytes()
    assert pki.ensure_pki(tmp_path / "pki").ca_cert.read_bytes() == before, "an existing CA is kept"


def test_kubernetes_version_comes_from_the_wrapper_module() -> None:
    version = build.kubernetes_version()
    go_mod = (build.KUBE_MODULE / "go.mod").read_text()
    assert version.startswith("v1.") and int(version.split(".")[1]) >= 33
    minor = version.split(".", 1)[1]
    # every staging module is replaced with the matching v0.X.Y release
    replaced = [line for line in go_mod.splitlines() if "=> k8s.io/" in line]
    assert len(replaced) >= 30
    assert all(line.strip().endswith(f"v0.{minor}") for line in replaced)


def test_the_aggregation_layer_has_its_own_ca_and_missing_files_are_added(tmp_path: Path) -> None:
    created = pki.ensure_pki(tmp_path / "pki")
    front_proxy_ca = x509.load_pem_x509_certificate(created.front_proxy_ca_cert.read_bytes())
    proxy_client = x509.load_pem_x509_certificate(created.client_cert(pki.FRONT_PROXY_CLIENT).read_bytes())
    proxy_client.verify_directly_issued_by(front_proxy_ca)
    assert proxy_client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == pki.FRONT_PROXY_CLIENT
    adapter = x509.load_pem_x509_certificate(created.adapter_serving_cert.read_bytes())
    adapter.verify_directly_issued_by(x509.load_pem_x509_certificate(created.ca_cert.read_bytes()))
    names = adapter.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    name, namespace = pki.ADAPTER_SERVICE
    assert f"{name}.{namespace}.svc" in names.get_values_for_type(x509.DNSName), "the name the aggregator checks"

    ca_before = created.ca_cert.read_bytes()
    created.adapter_serving_cert.unlink()  # a state folder from before the adapter existed
    pki.ensure_pki(tmp_path / "pki")
    assert created.ca_cert.read_bytes() == ca_before
    x509.load_pem_x509_certificate(created.adapter_serving_cert.read_bytes()).verify_directly_issued_by(
        x509.load_pem_x509_certificate(ca_before))


def test_scrape_targets_are_loopback_ports_of_pods_that_ask(tmp_path: Path) -> None:
    ports = {"metrics": 31236, "8002": 31236, "http": 31234, "8000": 31234}
    asks = {"prometheus.io/scrape": "true", "prometheus.io/port": "8002"}
    assert metrics.scrape_target("ml", "triton-0", asks, ports) == {
        "targets": ["127.0.0.1:31236"], "labels": {"namespace": "ml", "pod": "triton-0"}}
    assert metrics.scrape_target("ml", "p", {**asks, "prometheus.io/path": "/m"}, ports)["labels"][
        "__metrics_path__"] == "/m"
    assert metrics.scrape_target("ml", "p", {"prometheus.io/port": "8002"}, ports) is None, "not asked"
    assert metrics.scrape_target("ml", "p", {**asks, "prometheus.io/port": "9999"}, ports) is None, "no such port"
    assert metrics.scrape_target("ml", "p", None, ports) is None

    target_file = tmp_path / "scrape" / "pods.json"
    entry = metrics.scrape_target("ml", "p", asks, ports)
    assert metrics.write_targets(target_file, [entry])
    assert not metrics.write_targets(target_file, [entry]), "unchanged: not rewritten"
    assert json.loads(target_file.read_text()) == [entry]
    assert [p.name for p in target_file.parent.iterdir()] == ["pods.json"], "no staged file left"


def test_the_adapter_runs_the_charts_rules(tmp_path: Path) -> None:
    rules = metrics.adapter_config()["rules"]
    assert {rule["name"]["as"] for rule in rules} >= {"vllm_requests_waiting", "vllm_kv_cache_usage"}
    bad = tmp_path / "values.yaml"
    bad.write_text("rules:\n  default: false\n")
    with pytest.raises(ValueError, match=r"values\.yaml: rules\.custom: expected a list"):
        metrics.adapter_config(bad)


@pytest.mark.parametrize(("lifecycle", "seconds"), [
    ({"preStop": {"sleep": {"seconds": 7}}}, 7.0),
    ({"preStop": {"exec": {"command": ["sleep", "5"]}}}, 5.0),  # what the operator gives Triton
    ({"preStop": {"exec": {"command": ["sh", "-c", "sleep 5"]}}}, 0.0),  # not run here: no delay
    (None, 0.0),
])
def test_the_executor_delays_sigterm_by_a_pre_stop_sleep(lifecycle: dict[str, Any] | None, seconds: float) -> None:
    assert executor._pre_stop_sleep({"name": "triton", "lifecycle": lifecycle}) == seconds
