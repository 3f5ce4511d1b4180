"""Running the real Triton Inference Server that the nvidia-pytriton wheel ships (2.51, CPU capable).

The Python backend needs a backend folder holding libtriton_python.so, triton_python_backend_utils.py
and the stub for this Python version; symlinks keep the binaries' relative library lookups working. The
stub embeds libpython and takes its prefix from the `python3` first on PATH (this environment's), and
must load this interpreter's libpython (LD_LIBRARY_PATH), not the system one it was linked against.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tailor.compressor.sizing.engines import ENGINE_ARGS_FILE

READY_TIMEOUT_S = 300.0
VLLM_VENV_VARIABLE = "TAILOR_VLLM_VENV"
# vLLM's CPU build: every core runs the model (by default it keeps one back), and no model hub. The engine runs
# niced (vllm_backend.ENGINE_NICE_VARIABLE): its threads take every core they can, and Triton abandons a model
# whose Python stub misses a one-second health check while `initialize` starts the engine.
VLLM_CPU_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1", "TAILOR_ENGINE_NICE": "10"}
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int

    @classmethod
    def free(cls) -> Ports:
        """Three ports nothing listens on now."""
        sockets = [socket.socket() for _ in range(3)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
        for s in sockets:
            s.close()
        return cls(*ports)


def _bundle() -> Path:
    try:
        import pytriton
    except ImportError as error:
        raise RuntimeError("tritonserver comes from the nvidia-pytriton wheel: install tailor[compressor]") from error
    return Path(pytriton.__file__).parent / "tritonserver"


def vllm_environment() -> Path:
    """The virtual environment of vLLM's CPU build (`tailor engine setup`): $TAILOR_VLLM_VENV, else
    `.venv-vllm` beside this environment."""
    return Path(os.environ.get(VLLM_VENV_VARIABLE) or Path(sys.prefix).parent / ".venv-vllm")


def backend_folder(into: Path) -> Path:
    """A backend folder with the wheel's Python backend (its libraries and stub as symlinks)."""
    bundle = _bundle()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = bundle / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"{stub}: the wheel has no Python-backend stub for Python {version}")
    python = into / "python"
    python.mkdir(parents=True, exist_ok=True)
    for source in (bundle / "backends" / "python" / "triton_python_backend_utils.py", stub):
        (python / source.name).symlink_to(source)
    # a real file: the server refuses a backend library that resolves outside the backend folder (it checks
    # for the Python-based `vllm` backend); its libraries come through LD_LIBRARY_PATH (`environment`)
    shutil.copy2(bundle / "backends" / "python" / "libtriton_python.so", python / "libtriton_python.so")
    return into


def serves_vllm(repository: Path) -> bool:
    """Whether a repository holds a vLLM model (one with engine arguments beside its model.py)."""
    return any(repository.glob(f"*/*/{ENGINE_ARGS_FILE}"))


def _repository_arg(args: list[str]) -> Path | None:
    for index, arg in enumerate(args):
        if arg.startswith("--model-repository="):
            return Path(arg.split("=", 1)[1])
        if arg == "--model-repository" and index + 1 < len(args):
            return Path(args[index + 1])
    return None


def environment(repository: Path | None) -> dict[str, str]:
    """What the Python backend's stub needs: the `python3` first on PATH is the environment it embeds
    (vLLM's for a repository of vLLM models, else this one), and LD_LIBRARY_PATH finds this interpreter's
    libpython (the environments share their base interpreter)."""
    engine = vllm_environment() if repository is not None and serves_vllm(repository) else None
    if engine is not None and not (engine / "bin" / "python3").exists():
        raise RuntimeError(f"{repository} has vllm models but {engine} holds no vLLM environment: run "
                           f"`tailor engine setup` (or set {VLLM_VENV_VARIABLE})")
    bin_dir = engine / "bin" if engine is not None else Path(sys.executable).parent
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    libdir = sysconfig.get_config_var("LIBDIR") if sysconfig.get_config_var("Py_ENABLE_SHARED") else None
    bundled = _bundle().parent.parent / "nvidia_pytriton.libs"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, str(bundled), os.environ.get("LD_LIBRARY_PATH")]))
    if engine is not None:
        env.update(VLLM_CPU_ENV)
    return env


def local_command(args: list[str], work: Path) -> tuple[list[str], dict[str, str]]:
    """The bundled tritonserver with `args` (as a Triton image's `tritonserver` takes them), its backends set
    up under `work`, and the variables its environment needs (`environment`)."""
    backends = backend_folder(work / "backends")
    return [str(_bundle() / "bin" / "tritonserver"), *args, f"--backend-directory={backends}",
            "--allow-gpu-metrics=false"], environment(_repository_arg(args))


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message carries the end of its log."""


@dataclass
class RunningServer:
    process: subprocess.Popen[bytes]
    ports: Ports
    log: Path

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}/metrics"

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with status {self.process.returncode}:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.5)
        raise ServerError(f"tritonserver not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after a grace period; the exit status. Whatever the server started and left
        behind (a vLLM engine's core and worker processes outlive a stub that is killed) goes with its process
        group: the server leads a session of its own."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(ProcessLookupError):  # nothing was left
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.returncode


@contextmanager
def triton_server(repository: Path, ports: Ports | None = None, *, explicit: bool = False,
                  load: list[str] | None = None, log: Path | None = None,
                  timeout: float = READY_TIMEOUT_S) -> Iterator[RunningServer]:
    """tritonserver on 127.0.0.1 serving `repository`, ready; stopped on exit. With `explicit`, models load
    only on request (or those in `load`)."""
    if not repository.is_dir():
        raise ServerError(f"{repository}: no such model repository")
    ports = ports or Ports.free()
    work = Path(tempfile.mkdtemp(prefix="tailor-triton-"))
    log = log or work / "tritonserver.log"
    args = [f"--model-repository={repository.resolve()}", "--http-address=127.0.0.1", f"--http-port={ports.http}",
            "--grpc-address=127.0.0.1", f"--grpc-port={ports.grpc}", "--metrics-address=127.0.0.1",
            f"--metrics-port={ports.metrics}", "--allow-metrics=true", "--exit-timeout-secs=10"]
    if explicit:
        args.append("--model-control-mode=explicit")
        args += [f"--load-model={name}" for name in load or []]
    command, extra = local_command(args, work)
    env = {**os.environ, **extra}
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=work,
                                   start_new_session=True)  # the stub puts its working folder on sys.path
    server = RunningServer(process, ports, log)
    try:
        server.wait_ready(timeout)
        yield server
    finally:
        server.stop()
        shutil.rmtree(work / "backends", ignore_errors=True)
