"""Pool sizing on the devcluster's simulated pools, and the serving manifests built from it."""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import pytest
import yaml

from tailor.compressor.compute import NFD_CPUID, nfd_labels
from tailor.compressor.model.architecture import load_architecture
from tailor.compressor.serving.codecheck import CODE_ENV
from tailor.compressor.sizing.engines import Engine, cache_bytes
from tailor.compressor.sizing.hardware import GpuCatalog, resolve_precision
from tailor.compressor.sizing.memory import KvDtype, kv_bytes_per_token, recipe_for
from tailor.devcluster.nodes import EXECUTOR_LABEL
from tailor.operator import pools
from tailor.operator.api import RUNTIME_IMAGE, SERVING_IMAGE, CompressedModel, ResourceRequirements
from tailor.operator.conditions import Refused
from tailor.operator.deployment import LOAD_BYTES_PER_SECOND, autoscaler, manifests, service
from tailor.operator.memo import IdentityMemo
from tailor.operator.placement import gpu_terms
from tailor.operator.pools import (
    Built,
    HeldGpus,
    NodeSnapshot,
    PoolPlan,
    held_by_others,
    held_gpus,
    node_gpu,
)

from compressedmodels import plan_deployment
from corpus import EXAMPLES
from fakekube import ready_nodes

CHILD = load_architecture("nemotron-3-puzzle-75b-a9b")  # the published Puzzle child, 75.3B / 9.3B
NODES = ready_nodes()
CATALOG = GpuCatalog.load()


def plan_pools(model: CompressedModel, nodes: list[dict[str, Any]]) -> list[PoolPlan]:
    """Pools sized for the child as the spec's precision builds it (the quantize Job's recipe), FP8 KV."""
    target = CATALOG.get(model.spec.compression.target_gpu.value)
    recipe = recipe_for(resolve_precision(model.spec.quantization.precision, target), CHILD)
    assert model.spec.deployment is not None
    return plan_deployment(model.spec.deployment, nodes, Built(arch=CHILD, recipe=recipe, kv_dtype=KvDtype.FP8),
                           CATALOG)

H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
A100 = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load(next(path for path in EXAMPLES if path.stem == name).read_text())


def spec_with(base: str, pools: list[dict[str, Any]], **deployment: Any) -> CompressedModel:
    manifest = copy.deepcopy(example(base))
    manifest["spec"]["deployment"].update(pools=pools, **deployment)
    if "contextLength" in deployment:  # the child is compressed for the context it serves
        manifest["spec"]["compression"]["contextLength"] = deployment["contextLength"]
    return CompressedModel.model_validate(manifest)


def test_the_published_case_fits_8_million_token_requests_per_h100() -> None:
    # the NVFP4 child (quantized for Blackwell) served on H100s as W4A16, 10^6 tokens per request
    model = spec_with("nemotron-super-b200", [{"name": "h100", "nodeSelector": H100, "concurrency": {"perNode": 64}},
                                              {"name": "a100", "nodeSelector": A100, "concurrency": {"perNode": 8}}],
                      contextLength=1_000_000, maxReplicas=16)
    h100, a100 = plan_pools(model, NODES)
    assert (h100.tensor_parallel, h100.concurrency_per_gpu, h100.recipe) == (1, 8, "nvfp4-mamba-moe")
    assert h100.target_concurrency == 128 and h100.replicas == 16  # 2 nodes x 64 requests / 8 per replica
    assert any("weight-only NVFP4" in note for note in h100.notes)
    assert a100.skipped is not None and "A100-40GB (ampere) has no FP8 math" in a100.skipped
    assert a100.replicas is None


def test_fp8_weights_need_two_h100s_per_replica_and_max_replicas_caps_the_target() -> None:
    manifest = example("nemotron-super-h100")
    manifest["spec"]["quantization"]["precision"] = "fp8"
    model = CompressedModel.model_validate(manifest)
    (h100,) = plan_pools(model, NODES)
    assert h100.recipe == "fp8-mamba-moe" and h100.tensor_parallel == 2
    assert h100.concurrency_per_replica is not None and h100.concurrency_per_replica >= 16
    assert h100.replicas == 2 and "maxReplicas allow 2" in h100.notes[-1]


def test_pools_without_nodes_or_gpus_are_skipped_with_the_reason() -> None:
    model = spec_with("nemotron-super-h100", [
        {"name": "none", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-GB300"}, "concurrency": {"total": 1}},
        {"name": "cpu", "nodeSelector": {"tailor.dev/node-pool": "cpu"}, "concurrency": {"total": 1}}])
    missing, cpu = plan_pools(model, NODES)
    assert missing.skipped == "no node matches nodeSelector {'nvidia.com/gpu.product': 'NVIDIA-GB300'}"
    assert cpu.skipped is not None and "allocatable nvidia.com/gpu" in cpu.skipped  # CPU nodes have no GPUs


def pool(name: str) -> dict[str, Any]:
    return {"name": name, "nodeSelector": {"tailor.dev/node-pool": name}, "concurrency": {"perNode": 8}}


def test_nodes_are_found_however_the_cluster_labels_their_gpus() -> None:
    """GKE without the GPU Operator (its accelerator label), EKS with the device plugin only (the instance type)
    and GFD's other product name for an H100 all size as their GPU; MIG slices are skipped, saying so."""
    model = spec_with("nemotron-super-b200", [pool("gke-h100"), pool("eks-h200"), pool("h100-sxm5"),
                                              pool("a100-mig")], contextLength=65536, maxReplicas=16)
    gke, eks, sxm5, mig = plan_pools(model, NODES)
    assert (gke.gpu_profile, gke.gpu_product, gke.skipped) == ("H100-80GB", "nvidia-h100-80gb", None)
    assert (eks.gpu_profile, eks.gpu_product, eks.skipped) == ("H200-141GB", "p5e.48xlarge", None)
    assert (sxm5.gpu_profile, sxm5.gpu_product) == ("H100-80GB", "NVIDIA-H100-SXM5-80GB")
    assert gke.concurrency_per_gpu == sxm5.concurrency_per_gpu and eks.concurrency_per_gpu > gke.concurrency_per_gpu
    assert mig.skipped is not None and "partitions its GPUs with MIG" in mig.skipped
    assert "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb" in mig.skipped


def test_a_node_no_profile_knows_or_whose_memory_disagrees_is_skipped_naming_the_label() -> None:
    nodes = copy.deepcopy(NODES)
    gke = next(n for n in nodes if n["metadata"]["name"] == "gke-h100-0")
    gke["metadata"]["labels"]["cloud.google.com/gke-accelerator"] = "nvidia-rtx-pro-6000"
    sxm5 = next(n for n in nodes if n["metadata"]["name"] == "h100-sxm5-0")
    sxm5["metadata"]["labels"]["nvidia.com/gpu.memory"] = "95830"  # an H100 NVL, not an SXM 80 GB
    model = spec_with("nemotron-super-b200", [pool("gke-h100"), pool("h100-sxm5")], contextLength=65536)
    unknown, other = plan_pools(model, nodes)
    assert unknown.skipped is not None and "cloud.google.com/gke-accelerator=nvidia-rtx-pro-6000" in unknown.skipped
    assert "gfdProducts or nodeLabels" in unknown.skipped
    assert other.skipped is not None and "nvidia.com/gpu.memory=95830 MiB" in other.skipped


def test_a_platform_teams_own_label_names_a_gpu_through_the_profiles(tmp_path: Any) -> None:
    override = tmp_path / "gpus.yaml"
    override.write_text("profiles:\n  - name: H100-80GB\n    nodeLabels: {example.com/accelerator: [h100]}\n")
    catalog = GpuCatalog.load(override)
    node = {"metadata": {"name": "n", "labels": {"example.com/accelerator": "h100"}}}
    assert node_gpu(node, catalog)[0] == catalog.get("H100")
    assert node_gpu(node, CATALOG) == (None, "no GPU profile knows node n's GPU labels (none): add its label to a "
                                             "profile's gfdProducts or nodeLabels (the chart's gpuProfiles)")
    terms = gpu_terms(catalog.get("H100"))
    # stage Jobs for this GPU select any node labelled so (an override's nodeLabels replace the built-in ones)
    assert {(t["matchExpressions"][0]["key"], tuple(t["matchExpressions"][0]["values"])) for t in terms} == {
        ("nvidia.com/gpu.product", ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-SXM5-80GB")),
        ("example.com/accelerator", ("h100",))}


def test_manifests_request_the_replicas_gpus_and_probe_triton() -> None:
    manifest = example("nemotron-super-h100")
    manifest["spec"]["quantization"]["precision"] = "fp8"
    model = CompressedModel.model_validate(manifest)
    (plan,) = plan_pools(model, NODES)
    owner = {"metadata": {"name": "nemotron-super-h100", "namespace": "default", "uid": "1234"}}
    assert model.spec.deployment is not None
    engine = {"max_num_seqs": 7}
    code = {"g1/repo/repository/m/1/model.py": "a" * 64, "g1/repo/repository/m/config.pbtxt": "b" * 64}
    deployment, budget, autoscaler = manifests(owner, plan, model.spec.deployment, "artifacts", "g1/repo", 3,
                                               model.spec.deployment.triton_image, code, engine,
                                               frontend_image=RUNTIME_IMAGE)
    pool_service = service(owner, plan.name, 3, Engine.VLLM)
    assert deployment["metadata"]["name"] == "nemotron-super-h100-h100-g3"
    assert pool_service["metadata"]["name"] == "nemotron-super-h100-h100"
    assert pool_service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["selector"]["matchLabels"]["tailor.dev/revision"] == "g3"
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert deployment["spec"]["replicas"] == plan.replicas
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["resources"]["requests"] == {"cpu": "1000m", "memory": "4Gi", "nvidia.com/gpu": "2"}
    # host memory on GPUs is assumed: 8 GiB per worker and 2 for the server, x 1.25, and /dev/shm: 16 GiB for
    # the tensor-parallel workers, and for the requests a replica holds (64 MiB, and 24 bytes a token in flight)
    shm = 16 * 2**30 + 64 * 2**20 + 24 * plan.concurrency_per_replica * model.spec.deployment.context_length
    assert container["resources"]["limits"]["memory"] == f"{math.ceil((18 * 1.25 * 2**30 + shm) / 2**20)}Mi"
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{math.ceil(shm / 2**20)}Mi"}} in pod[
        "volumes"]
    # it writes only to its mounts: the root filesystem is read-only, HOME and the engine's caches are in scratch
    for each in pod["containers"]:
        env = {e["name"]: e["value"] for e in each["env"]}
        assert each["securityContext"]["readOnlyRootFilesystem"] is True
        assert {"name": "scratch", "mountPath": "/tmp"} in each["volumeMounts"]
        assert all(env[name].startswith("/tmp") for name in ("HOME", "TMPDIR", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT",
                                                             "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"))
    assert {"name": "scratch", "emptyDir": {"sizeLimit": "20Gi"}} in pod["volumes"]
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    assert deployment["spec"]["progressDeadlineSeconds"] == container["startupProbe"]["failureThreshold"] * 10 + 300
    assert pod["nodeSelector"] == H100 and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # a replica's weights at 200 MB/s, then vLLM's 10 minutes of compilation and CUDA graphs, in 10 s periods
    loading = 2 * plan.sizing.footprint.weights / LOAD_BYTES_PER_SECOND  # type: ignore[union-attr]
    assert container["startupProbe"]["failureThreshold"] == math.ceil(math.ceil(loading + 600) / 10) > 60
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"  # a crash leaves its last log lines
    assert "--model-repository=/models/g1/repo/repository" in container["args"]
    # the image's own backends: its Python backend runs the repository's model.py (tailor's vLLM backend), once
    # the image's shell has checked the code against what the package Job wrote
    assert container["command"][:2] == ["sh", "-c"] and "sha256sum --check" in container["command"][2]
    assert container["args"][:2] == ["/models", "tritonserver"]
    assert not any("backend" in arg for arg in container["args"])
    assert {"name": CODE_ENV, "value": f"{'a' * 64}  g1/repo/repository/m/1/model.py\n"
                                       f"{'b' * 64}  g1/repo/repository/m/config.pbtxt"} in container["env"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]  # no model hub: only the claim's files
    assert [p["port"] for p in pool_service["spec"]["ports"]] == [8000, 8001, 8002, 9000]
    # the OpenAI-compatible API beside Triton, reaching it on the pod's loopback, from the runtime image
    frontend = pod["containers"][1]
    assert (frontend["name"], frontend["image"], frontend["command"]) == ("openai", RUNTIME_IMAGE,
                                                                          ["tailor", "openai"])
    assert frontend["args"] == ["--model-repository=/models/g1/repo/repository", "--triton-port=8000",
                                "--openai-port=9000"]
    assert frontend["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
    assert "nvidia.com/gpu" not in frontend["resources"]["requests"]
    assert container["image"] == SERVING_IMAGE and plan.engine is Engine.VLLM
    assert deployment["metadata"]["annotations"] == {"tailor.dev/engine": "vllm",
                                                     "tailor.dev/engine-args": '{"max_num_seqs": 7}'}
    # target derived from the sizing: a quarter of max_num_seqs waiting per replica; KV-cache usage as well
    assert [(m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"]) for m in
            autoscaler["spec"]["metrics"]] == [("vllm_requests_waiting", str(math.ceil(plan.max_num_seqs() / 4))),
                                              ("vllm_kv_cache_usage", "900m")]
    assert autoscaler["spec"]["minReplicas"] == 1 and autoscaler["spec"]["maxReplicas"] == 2
    assert budget["spec"]["minAvailable"] == 1  # a drain never takes the last ready replica
    down = autoscaler["spec"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] == 300 and down["policies"] == [
        {"type": "Pods", "value": 1, "periodSeconds": 60}]
    # drained on the way out: Triton finishes what it holds within drainSeconds, inside the grace period
    assert "--exit-timeout-secs=600" in container["args"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]  # kube-proxy catches up first
    assert pod["terminationGracePeriodSeconds"] > 600 + 5
    assert all(m["metadata"]["ownerReferences"][0]["uid"] == "1234" for m in (deployment, pool_service, budget))
    with pytest.raises(ValueError, match="skipped"):
        manifests(owner, plan.model_copy(update={"skipped": "no nodes"}), model.spec.deployment, "a", "r", 1, "i",
                  None)


def test_a_cpu_replica_requests_and_is_limited_to_its_weights_cache_and_runtime() -> None:
    """On the cpu profile a replica holds its weights and its whole KV cache in RAM: the request is that and the
    measured runtime, the limit 1.25 times it (the old Deployment asked for a 2Gi floor and had no limit); a
    pool's own memory request above Tailor's limit raises the limit, and its own limit wins."""
    model = CompressedModel.model_validate(example("smollm2-135m-cpu"))
    smol = load_architecture("smollm2-135m")
    assert model.spec.deployment is not None
    (plan,) = plan_deployment(model.spec.deployment, NODES, Built(arch=smol, recipe=recipe_for(
        resolve_precision("bf16", CATALOG.get("cpu")), smol), kv_dtype=KvDtype.BF16), CATALOG)
    assert plan.host is not None and plan.sizing is not None and plan.engine is Engine.VLLM
    cache = cache_bytes(CATALOG.get("cpu"), plan.sizing, plan.max_num_seqs())
    assert plan.host.parts == {"weights": plan.sizing.footprint.weights, "KV cache and state": cache,
                               "runtime": 3 * 2**30} and not plan.host.assumed
    owner = {"metadata": {"name": "smol", "namespace": "default", "uid": "1234"}}

    def resources(pool: dict[str, Any] | None = None) -> dict[str, Any]:
        deployment = model.spec.deployment
        assert deployment is not None
        if pool is not None:
            deployment = deployment.model_copy(update={"pools": [
                deployment.pools[0].model_copy(update={"resources": ResourceRequirements.model_validate(pool)})]})
        made = manifests(owner, plan, deployment, "artifacts", "g1/repo", 1, deployment.triton_image, None, {},
                         frontend_image=RUNTIME_IMAGE)[0]
        return dict(made["spec"]["template"]["spec"]["containers"][0]["resources"])

    total = plan.host.total
    # and the /dev/shm its Python backend hands its requests through (64 MiB, 24 bytes a token in flight)
    shm = 64 * 2**20 + 24 * plan.concurrency_per_replica * model.spec.deployment.context_length
    assert resources() == {"requests": {"cpu": "500m", "memory": f"{math.ceil(total / 2**20)}Mi",
                                        "nvidia.com/gpu": "1"},
                           "limits": {"memory": f"{math.ceil((total * 1.25 + shm) / 2**20)}Mi",
                                      "nvidia.com/gpu": "1"}}
    assert resources({"requests": {"memory": "64Gi"}})["limits"]["memory"] == "64Gi"
    assert resources({"requests": {"memory": "8Gi"}, "limits": {"memory": "16Gi"}})["limits"]["memory"] == "16Gi"
    with pytest.raises(Refused, match="the memory limit 1Pi is more than 4x the request"):
        resources({"limits": {"memory": "1Pi"}})  # scheduled as a few GiB, free to take the node
    with pytest.raises(Refused, match="the memory request 1 is below a 4th of Tailor's"):
        resources({"requests": {"memory": "1"}})


@pytest.mark.parametrize(("autoscaling", "engine", "expected"), [
    ({"metric": "requestsWaiting", "target": 3}, Engine.VLLM, [("vllm_requests_waiting", "3"),
                                                               ("vllm_kv_cache_usage", "900m")]),
    ({"metric": "kvCacheUsage"}, Engine.VLLM, [("vllm_kv_cache_usage", "800m")]),
    ({"metric": "queueTimeSeconds", "kvCacheTarget": 0.75}, Engine.VLLM, [("vllm_queue_time_seconds", "2"),
                                                                          ("vllm_kv_cache_usage", "750m")]),
    ({"metric": "requestsWaiting"}, Engine.PYTHON, [("triton_requests_waiting", "1")]),  # no KV metric there
    ({"metric": "kvCacheUsage"}, Engine.PYTHON, [("triton_requests_waiting", "1")]),  # its waiting count, not 0.8
])
def test_hpa_metrics_and_targets(autoscaling: dict[str, Any], engine: Engine, expected: list[tuple[str, str]]
                                 ) -> None:
    model = spec_with("nemotron-super-h100", [{"name": "h100", "nodeSelector": H100, "concurrency": {"total": 8}}],
                      autoscaling=autoscaling)
    assert model.spec.deployment is not None
    (plan,) = plan_pools(model, NODES)
    plan = plan.model_copy(update={"engine": engine, "concurrency_per_replica": 2})  # derived: ceil(2 / 4) = 1
    spec = autoscaler(plan, model.spec.deployment)
    assert [(m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"]) for m in spec["metrics"]] == expected


def test_scale_to_zero_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=re.escape("minReplicas 0 (scale to zero) is not supported")):
        spec_with("nemotron-super-h100", [{"name": "h100", "nodeSelector": H100, "concurrency": {"total": 8}}],
                  minReplicas=0)


def test_a_pool_is_sized_only_on_nodes_its_pods_can_land_on() -> None:
    """A taint the pool does not tolerate, or a required node-affinity term its nodes do not meet, leaves no node
    to size on, and the pool says which; tolerating the taint makes it a pool again."""
    tainted = copy.deepcopy([node for node in NODES if all(
        node["metadata"]["labels"].get(k) == v for k, v in H100.items())])
    for node in tainted:
        node["spec"] = {**node.get("spec", {}), "taints": [{"key": "example.com/reserved", "value": "serving",
                                                            "effect": "NoSchedule"}]}
    pool = {"name": "h100", "nodeSelector": H100, "concurrency": {"perNode": 8}}
    (skipped,) = plan_pools(spec_with("nemotron-super-h100", [pool]), tainted)
    assert skipped.skipped is not None and "has the taint example.com/reserved=serving:NoSchedule" in skipped.skipped
    tolerated = {**pool, "tolerations": [{"key": "example.com/reserved", "value": "serving"}]}
    (sized,) = plan_pools(spec_with("nemotron-super-h100", [tolerated]), tainted)
    assert sized.skipped is None and sized.replicas
    elsewhere = {**tolerated, "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["zone-b"]}]}]}}}
    (away,) = plan_pools(spec_with("nemotron-super-h100", [elsewhere]), tainted)
    assert away.skipped is not None and "meets none of the pool's nodeAffinity required terms" in away.skipped


def test_a_pool_sets_its_own_startup_allowance() -> None:
    """startupSeconds replaces the derived allowance (weights and warm-up); the revision's deadline follows it."""
    pool = {"name": "h100", "nodeSelector": H100, "concurrency": {"perNode": 8}, "startupSeconds": 3600}
    model = spec_with("nemotron-super-h100", [pool])
    (plan,) = plan_pools(model, NODES)
    owner = {"metadata": {"name": "m", "namespace": "default", "uid": "1234"}}
    assert model.spec.deployment is not None
    deployment, *_ = manifests(owner, plan, model.spec.deployment, "artifacts", "g1/repo", 1,
                               model.spec.deployment.triton_image, None)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["startupProbe"]["failureThreshold"] == 360
    assert deployment["spec"]["progressDeadlineSeconds"] == 3600 + 300


def gpu_pod(node: str, gpus: int, namespace: str = "other", labels: dict[str, str] | None = None,
            phase: str = "Running", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": f"p-{node}", "namespace": namespace, "labels": labels or {}},
            "spec": {"nodeName": node, "containers": [{"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
                     **spec},
            "status": {"phase": phase}}


def test_the_gpus_a_pod_holds_are_counted_as_the_scheduler_counts_them() -> None:
    """Containers and sidecars add up; a plain init step holds its GPUs only while it runs, beside the sidecars
    started before it, so the larger counts; a pod not bound, finished or without GPUs holds none."""
    sidecar = {"restartPolicy": "Always", "resources": {"limits": {"nvidia.com/gpu": "2"}}}
    init = {"resources": {"requests": {"nvidia.com/gpu": "8"}}}
    held = held_gpus(gpu_pod("n1", 1, initContainers=[sidecar]))
    assert held is not None and (held.node, held.gpus) == ("n1", 3)
    held = held_gpus(gpu_pod("n1", 1, initContainers=[init, sidecar]))
    assert held is not None and held.gpus == 8
    held = held_gpus(gpu_pod("n1", 1, initContainers=[sidecar, init]))  # the sidecar runs beside the init step
    assert held is not None and held.gpus == 10
    assert held_gpus(gpu_pod("", 4)) is None  # not bound yet
    assert held_gpus(gpu_pod("n1", 4, phase="Succeeded")) is None
    assert held_gpus(gpu_pod("n1", 0)) is None


def test_a_pool_is_sized_by_the_gpus_other_pods_leave_free() -> None:
    """Replicas are capped at what the free GPUs hold and the status notes who holds the rest; the revision's own
    pods are not others; where pods cannot be listed, all allocatable GPUs count and the note says so."""
    h100_nodes = [n["metadata"]["name"] for n in NODES
                  if all(n["metadata"]["labels"].get(k) == v for k, v in H100.items())]
    assert len(h100_nodes) == 2  # 8 GPUs each
    model = spec_with("nemotron-super-h100", [{"name": "h100", "nodeSelector": H100, "concurrency": {"perNode": 96}}],
                      maxReplicas=16)

    def sized(held: dict[str, int] | None, per_node: int = 96, counted_in: tuple[str, ...] | None = None
              ) -> PoolPlan:
        target = CATALOG.get(model.spec.compression.target_gpu.value)
        recipe = recipe_for(resolve_precision(model.spec.quantization.precision, target), CHILD)
        assert model.spec.deployment is not None
        deployment = model.spec.deployment.model_copy(update={"pools": [
            pool.model_copy(update={"concurrency": pool.concurrency.model_copy(update={"per_node": per_node})})
            for pool in model.spec.deployment.pools]})
        (plan,) = plan_deployment(deployment, NODES, Built(arch=CHILD, recipe=recipe, kv_dtype=KvDtype.FP8),
                                  CATALOG, held, counted_in)
        return plan

    free = sized({})
    assert (free.tensor_parallel, free.replicas) == (1, 16)  # 192 requests need 24 replicas; 16 GPUs hold 16
    revision = {"tailor.dev/model": "m", "tailor.dev/revision": "g1"}
    pods = [HeldGpus(node=h100_nodes[0], namespace="other", gpus=6),
            HeldGpus(node=h100_nodes[1], namespace="team", gpus=1, labels={**revision, "x": "y"}),  # its own
            HeldGpus(node=h100_nodes[1], namespace="elsewhere", gpus=4, labels=revision)]  # another "m"
    held = held_by_others(pods, "team", revision)
    assert held == {h100_nodes[0]: 6, h100_nodes[1]: 4}
    busy = sized(held)
    assert busy.replicas == 6 and "other pods hold 10 of the pool's 16 GPUs (on 2 node(s)): room for 6" in " ".join(
        busy.notes)
    assert "the pool's free GPUs allow 6" in busy.notes[-2]
    # 32 requests need 4 replicas: with GPUs held or not, the pool has room, and nothing in the notes follows
    # other tenants' pods as they come and go
    assert sized({}, per_node=16).replicas == sized({h100_nodes[0]: 6}, per_node=16).replicas == 4
    assert sized({h100_nodes[0]: 6}, per_node=16).notes == sized({}, per_node=16).notes
    assert sized({h100_nodes[0]: 12}).replicas == 8  # more than a node has: that node has none free
    unknown = sized(None)
    assert unknown.replicas == 16 and "GPUs other pods hold are not known" in " ".join(unknown.notes)
    partly = sized({h100_nodes[0]: 6}, counted_in=("team-a", "gpu-jobs"))  # pods listed only there
    assert "GPUs held by pods outside team-a, gpu-jobs are not counted" in " ".join(partly.notes)
    assert not any("not counted" in note for note in busy.notes)


def test_min_replicas_beyond_what_the_pools_nodes_can_ever_hold_skips_the_pool_with_the_reason() -> None:
    """16 H100s hold 16 one-GPU replicas: minReplicas 17 would leave a revision waiting forever for GPUs no node
    has (the old operator planned 17 replicas); other pods holding GPUs is no refusal, the revision waits."""
    pool = [{"name": "h100", "nodeSelector": H100, "concurrency": {"perNode": 8}}]
    (refused,) = plan_pools(spec_with("nemotron-super-h100", pool, minReplicas=17, maxReplicas=20), NODES)
    assert refused.replicas is None and refused.skipped == (
        "spec.deployment.minReplicas 17 needs 17 replicas of 1 GPU(s), but the pool's 2 schedulable node(s) hold at "
        "most 16 with every GPU free (16 allocatable): lower minReplicas or add nodes to the pool")
    (fits,) = plan_pools(spec_with("nemotron-super-h100", pool, minReplicas=16, maxReplicas=20), NODES)
    assert fits.skipped is None and fits.replicas == 16
    model = spec_with("nemotron-super-h100", pool, minReplicas=16, maxReplicas=20)
    assert model.spec.deployment is not None
    recipe = recipe_for(resolve_precision(model.spec.quantization.precision, CATALOG.get("H100-80GB")), CHILD)
    (busy,) = plan_deployment(model.spec.deployment, NODES, Built(arch=CHILD, recipe=recipe, kv_dtype=KvDtype.FP8),
                              CATALOG, {fits.nodes[0]: 4})
    assert busy.skipped is None and (busy.replicas, busy.capacity) == (16, 12)  # planned; waits for 4 GPUs


def test_what_a_pool_makes_of_a_node_snapshot_and_a_build_is_worked_out_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator reads the nodes once per `NODES_TTL_S` for every pass: a pool's view of that snapshot, and the
    sizing of one build on one GPU, are computed once; nodes read again, or another build, are worked out anew."""
    calls = {"_pool_nodes": 0, "_sizing": 0}
    for name in calls:
        real = getattr(pools, name)
        monkeypatch.setattr(pools, name, lambda *args, real=real, name=name: calls.__setitem__(name, calls[name] + 1)
                            or real(*args))
    model = spec_with("nemotron-super-b200", [{"name": "h100", "nodeSelector": H100, "concurrency": {"perNode": 64}}],
                      contextLength=1_000_000)
    deployment = model.spec.deployment
    assert deployment is not None
    target = CATALOG.get(model.spec.compression.target_gpu.value)
    build = Built(arch=CHILD, recipe=recipe_for(resolve_precision(model.spec.quantization.precision, target), CHILD),
                  kv_dtype=KvDtype.FP8)
    snapshot = NodeSnapshot(NODES)
    first, again = (plan_deployment(deployment, snapshot, build, CATALOG) for _ in range(2))
    assert first == again and first[0].concurrency_per_gpu == 8
    assert calls == {"_pool_nodes": 1, "_sizing": 1}
    plan_deployment(deployment, NodeSnapshot(NODES), build, CATALOG)  # the nodes read again
    plan_deployment(deployment, NODES, build, CATALOG)  # a plain list (a test's nodes) is never kept
    assert calls == {"_pool_nodes": 3, "_sizing": 1}
    plan_deployment(deployment, snapshot, build.model_copy(), CATALOG)  # an equal build, read again
    assert calls == {"_pool_nodes": 3, "_sizing": 2}
    assert type(copy.copy(snapshot)) is list and type(copy.deepcopy(snapshot)) is list  # copies keep no memo


def test_an_identity_memo_keeps_its_recently_used_entries_and_never_mixes_objects_up() -> None:
    memo, computed = IdentityMemo(2), []
    first, second, third = object(), object(), object()
    for thing in (first, second, first, third, first, second):
        memo.get((thing,), ("x",), lambda thing=thing: computed.append(thing) or id(thing))
    assert computed == [first, second, third, second]  # `second` was the least recently used when `third` came
    assert memo.get((second,), ("y",), lambda: "other extras") == "other extras"


@pytest.mark.parametrize(("flags", "dtype", "kv", "weight_bytes"), [
    ({"avx2"}, "float32", KvDtype.FP32, 4),  # no BF16 math: the engine widens the BF16 child
    ({"avx2", "avx512f", "amx_bf16"}, "bfloat16", KvDtype.BF16, 2),
])
def test_a_cpu_pool_computes_in_what_its_nodes_cpus_have_math_for(flags: set[str], dtype: str, kv: KvDtype,
                                                                   weight_bytes: int) -> None:
    """The executor node labelled as Node Feature Discovery labels its CPU: the engine's dtype, its KV cache and
    the weights it holds follow `compute.resolve`, and the engine arguments say so."""
    model = CompressedModel.model_validate(example("smollm2-135m-cpu"))
    smol = load_architecture("smollm2-135m")
    nodes = copy.deepcopy(NODES)
    for node in nodes:
        labels = node["metadata"]["labels"]
        if labels.get(EXECUTOR_LABEL) == "true":
            node["metadata"]["labels"] = {key: value for key, value in labels.items() if NFD_CPUID not in key}
            node["metadata"]["labels"] |= nfd_labels(flags)
    assert model.spec.deployment is not None
    (plan,) = plan_deployment(model.spec.deployment, nodes, Built(arch=smol, recipe=recipe_for(
        resolve_precision("bf16", CATALOG.get("cpu")), smol), kv_dtype=KvDtype.BF16), CATALOG)
    assert plan.compute is not None and plan.compute.dtype == dtype and plan.sizing is not None
    assert plan.kv_dtype is kv and plan.sizing.kv_dtype is kv and plan.sizing.dtype == dtype
    assert plan.sizing.footprint.weights == weight_bytes * smol.total_params
    assert plan.sizing.footprint.kv_per_request == kv_bytes_per_token(smol, kv) * plan.sizing.context
    assert any(note.startswith(f"the engine computes in {dtype}: CPU of node local-0") for note in plan.notes)
    args = plan.serving(1, plan.sizing.context, CATALOG, "/models/child", False).engine_args
    assert args is not None and args["dtype"] == dtype and args["kv_cache_dtype"] == "auto"  # auto: the model dtype
