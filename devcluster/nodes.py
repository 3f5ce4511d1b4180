"""Simulated GPU node pools: a typed YAML file turned into Node objects that kwok keeps alive. The executor's
nodes (this machine) carry the CPUID labels Node Feature Discovery would give this CPU, which decide what a CPU
pool's engine computes in (`compute.processor_from_labels`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tailor.compressor.compute import nfd_labels

DEFAULT_POOLS_FILE = Path(__file__).parent / "nodepools.yaml"
POOL_LABEL = "tailor.dev/node-pool"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
EXECUTOR_LABEL = "tailor.dev/executor"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
MAX_PODS = "110"
CPUINFO = Path("/proc/cpuinfo")


def host_cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """This machine's CPU flags (/proc/cpuinfo), less the AVX-512 ones when `ATEN_CPU_CAPABILITY` makes torch
    act as a CPU without them (as `model.device.detect` reads it)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("default", "avx2"):
        flags = {flag for flag in flags if not flag.startswith(("avx512", "amx"))}
    return flags


class Gpu(BaseModel):
    """The GPUs of every node in a pool, as GPU Feature Discovery labels them (with a `product`), or with no GFD
    labels at all (no `product`: the node says what it has only through the pool's own `labels`, as GKE's driver
    installer or EKS's device plugin leave it)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    product: str | None = Field(None, description="nvidia.com/gpu.product, e.g. NVIDIA-H100-80GB-HBM3")
    count: int = Field(gt=0, description="GPUs per node")
    memory_mib: int = Field(alias="memoryMiB", gt=0, description="memory of one GPU in MiB")
    family: str = Field(description="nvidia.com/gpu.family, e.g. hopper")


class NodePool(BaseModel):
    """`count` identical nodes named `<name>-<i>`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    count: int = Field(gt=0)
    cpu: str
    memory: str
    gpu: Gpu | None = None
    labels: dict[str, str] = Field(default_factory=dict, description="More node labels, e.g. a cloud's.")
    executor: bool = Field(False, description="Run this pool's pods as local processes (the devcluster executor) "
                                              "instead of simulating them with kwok.")


class NodePools(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pools: list[NodePool] = Field(min_length=1)


def load_pools(path: Path = DEFAULT_POOLS_FILE) -> NodePools:
    """Read and validate a node-pools file; errors name the file and the field."""
    try:
        return NodePools.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ValueError(f"{path}: invalid node pools: {problems}") from error


def node_manifests(pools: NodePools) -> list[dict[str, Any]]:
    """Node objects for every pool; kwok manages them through the annotation."""
    nodes = []
    for pool in pools.pools:
        for index in range(pool.count):
            name = f"{pool.name}-{index}"
            labels = {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                POOL_LABEL: pool.name,
            }
            labels |= {EXECUTOR_LABEL: "true", **nfd_labels(host_cpu_flags())} if pool.executor else {"type": "kwok"}
            capacity = {"cpu": pool.cpu, "memory": pool.memory, "pods": MAX_PODS}
            taints = []
            labels |= pool.labels
            if pool.gpu is not None:
                if pool.gpu.product is not None:  # GPU Feature Discovery's labels
                    labels |= {
                        "nvidia.com/gpu.present": "true",
                        "nvidia.com/gpu.product": pool.gpu.product,
                        "nvidia.com/gpu.count": str(pool.gpu.count),
                        "nvidia.com/gpu.memory": str(pool.gpu.memory_mib),
                        "nvidia.com/gpu.family": pool.gpu.family,
                    }
                capacity[GPU_RESOURCE] = str(pool.gpu.count)
                taints.append(GPU_TAINT)
            nodes.append({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": labels,
                             "annotations": {} if pool.executor else {KWOK_ANNOTATION: "fake"}},
                "spec": {"taints": taints},
                # Nodes may set status on create; kwok's stages keep capacity and allocatable as given.
                "status": {"capacity": capacity, "allocatable": capacity},
            })
    return nodes
