"""Running the images `make images` builds (`images/build.py`), on this machine: in a buildah working container
with chroot isolation, since podman's runtime is refused `setrlimit` here. Such a process shares the host's
network, so servers started in it are bound to loopback (`executor.loopback_args`). What the image test and
`bench/images.py` share."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

STOP_WAIT_S = 30.0


@contextmanager
def working_container(image: str) -> Iterator[str]:
    """A working container of `image` (from local storage, never pulled), removed afterwards; its name."""
    name = subprocess.run(["buildah", "from", "--quiet", "--pull-never", image], check=True, text=True,
                          capture_output=True).stdout.strip()
    try:
        yield name
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True)


def run_argv(container: str, argv: list[str], user: str | None = None, volumes: Mapping[str, Path] | None = None,
             env: Mapping[str, str] | None = None) -> list[str]:
    """The `buildah run` command that runs `argv` in `container`, with `volumes` (target -> host folder)."""
    return ["buildah", "run", "--isolation", "chroot", *(["--user", user] if user else []),
            *(f"--volume={source}:{target}" for target, source in (volumes or {}).items()),
            *(f"--env={name}={value}" for name, value in (env or {}).items()), container, "--", *argv]


def run(container: str, argv: list[str], user: str | None = None) -> subprocess.CompletedProcess[str]:
    """`argv` run to its end in `container`; its exit code and output."""
    return subprocess.run(run_argv(container, argv, user), text=True, capture_output=True, timeout=600)


def start(container: str, argv: list[str], log: Path, user: str | None = None,
          volumes: Mapping[str, Path] | None = None, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`argv` started in `container`, its output appended to `log`, in a process group of its own (`stop`)."""
    with log.open("ab") as out:
        return subprocess.Popen(run_argv(container, argv, user, volumes, env), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to what `start` started (buildah and the process it runs), SIGKILL if it has not ended in time."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def image_bytes(reference: str) -> int:
    """The image's size in local storage, its layers unpacked."""
    return int(subprocess.run(["podman", "image", "inspect", "--format", "{{.Size}}", reference], check=True,
                              text=True, capture_output=True).stdout)
