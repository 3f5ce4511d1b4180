"""GPU profiles: built-ins, lookup, overrides, and agreement with the API and the devcluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailor.compressor.sizing.hardware import GpuCatalog, Precision, UnknownGpuError
from tailor.devcluster import nodes
from tailor.operator import api


@pytest.fixture(scope="module")
def catalog() -> GpuCatalog:
    return GpuCatalog.load()


def test_api_enum_lists_exactly_the_builtin_profiles(catalog: GpuCatalog) -> None:
    assert [p.value for p in api.TargetGpu] == catalog.names


def test_nvfp4_runs_natively_only_on_blackwell(catalog: GpuCatalog) -> None:
    native = {p.name for p in catalog.profiles.values() if p.runs_natively(Precision.NVFP4)}
    assert native == {p.name for p in catalog.profiles.values() if p.family == "blackwell"} == {
        "B200-180GB", "GB200-186GB"}
    assert all(p.runs_natively(Precision.BF16) for p in catalog.profiles.values())


def test_lookup_by_alias_is_case_insensitive(catalog: GpuCatalog) -> None:
    assert catalog.get("h100").name == "H100-80GB"
    assert catalog.get("b200").name == "B200-180GB"
    assert catalog.get("CPU").family == "cpu"


def test_unknown_gpu_lists_the_known_ones(catalog: GpuCatalog) -> None:
    with pytest.raises(UnknownGpuError, match=r"unknown GPU 'H300'; known profiles: H100-80GB, H200-141GB, .*cpu"):
        catalog.get("H300")


def test_every_devcluster_gpu_pool_maps_to_a_profile_with_its_memory(catalog: GpuCatalog) -> None:
    """However a pool's nodes are labelled (GFD, GKE, EC2), a profile names their GPU; MIG slices are no profile's."""
    pools = {pool.name: pool for pool in nodes.load_pools().pools}
    for node in nodes.node_manifests(nodes.load_pools()):
        gpu = pools[node["metadata"]["labels"][nodes.POOL_LABEL]].gpu
        if gpu is None or "-MIG-" in (gpu.product or ""):
            continue
        found = catalog.for_node(node["metadata"]["labels"])
        assert found is not None, node["metadata"]["name"]
        assert (found[0].memory_mib, found[0].family) == (gpu.memory_mib, gpu.family)


def test_override_file_changes_a_field_and_adds_a_profile(tmp_path: Path) -> None:
    override = tmp_path / "gpus.yaml"
    override.write_text(
        "profiles:\n"
        "  - name: H100-80GB\n    bandwidthGBps: 3000\n"
        "  - name: MI300X\n    family: cpu\n    memoryMiB: 196608\n    bandwidthGBps: 5300\n"
        "    tflops: {bf16: 1307}\n")
    catalog = GpuCatalog.load(override)
    assert catalog.get("H100").bandwidth_gbps == 3000
    assert catalog.get("H100").memory_mib == 81559  # untouched fields keep the built-in value
    assert catalog.get("mi300x").memory_bytes == 196608 * 1024**2


@pytest.mark.parametrize(("body", "expected"), [
    ("profiles:\n  - name: H100-80GB\n    memoryMiB: -1\n",
     r"gpus\.yaml: profiles\[0\] \(H100-80GB\): memoryMiB: Input should be greater than 0"),
    ("profiles:\n  - name: X1\n    family: hopper\n",
     r"profiles\[0\] \(X1\): memoryMiB: Field required"),
    ("profiles:\n  - name: H100-80GB\n    tflops: {fp4: 1}\n", r"tflops\.fp4\.\[key\]: Input should be 'bf16', 'fp8'"),
    ("gpus: []\n", r"gpus\.yaml: expected a mapping with a 'profiles' list"),
    ("profiles: [: bad\n", r"gpus\.yaml: cannot read GPU profiles"),
])
def test_bad_override_names_the_file_and_the_field(tmp_path: Path, body: str, expected: str) -> None:
    override = tmp_path / "gpus.yaml"
    override.write_text(body)
    with pytest.raises(ValueError, match=expected):
        GpuCatalog.load(override)


def test_fallback_note_says_what_happens_instead(catalog: GpuCatalog) -> None:
    note = catalog.get("H100").fallback_note(Precision.NVFP4)
    assert note is not None and "weight-only NVFP4 (W4A16)" in note and "FP8 is the faster choice" in note
    a100 = catalog.get("A100-80GB").fallback_note(Precision.FP8)
    assert a100 is not None and "weight-only FP8 (W8A16)" in a100
    assert catalog.get("B200").fallback_note(Precision.NVFP4) is None
