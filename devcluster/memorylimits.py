"""Memory limits for the executor's containers, enforced as a kubelet enforces them: a container with a memory
limit runs in a memory cgroup of its own (one per run), nested in the executor's, limited to
`resources.limits.memory`; when the kernel kills one of its processes for memory, the container ends `OOMKilled`.

cgroup v1's memory controller (as on this project's machines) or cgroup v2's, where the executor may make cgroups
below its own. Where it may not, limits are not enforced, and the executor says so once (`Limits.available`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

CGROUPS = Path("/sys/fs/cgroup")
SELF = Path("/proc/self/cgroup")
PARENT = "tailor-executor"
ENV = "TAILOR_SHIM_CGROUP"  # cgroup.procs of the container's cgroup: the shim joins it before it starts anything


@dataclass(frozen=True)
class Flavour:
    limit_file: str
    events_file: str  # holds `oom_kill N`


V1 = Flavour("memory.limit_in_bytes", "memory.oom_control")
V2 = Flavour("memory.max", "memory.events")


def _own() -> tuple[Path, Flavour] | None:
    """The executor's own memory cgroup and its flavour, from /proc/self/cgroup."""
    try:
        lines = SELF.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUPS / "memory" / path.lstrip("/"), V1
    for line in lines:
        if line.startswith("0::"):
            own = CGROUPS / line[3:].lstrip("/")
            with contextlib.suppress(OSError):
                if "memory" in (CGROUPS / "cgroup.controllers").read_text().split():
                    return own, V2
    return None


class Limits:
    """The executor's containers' cgroups, below `<its own cgroup>/tailor-executor`."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.flavour = V1
        found = _own()
        if found is not None:
            own, self.flavour = found
            with contextlib.suppress(OSError):
                (own / PARENT).mkdir(exist_ok=True)
                if self.flavour is V2:  # a v2 parent hands the memory controller down to its children
                    (own / PARENT / "cgroup.subtree_control").write_text("+memory")
                self.root = own / PARENT

    @property
    def available(self) -> bool:
        return self.root is not None

    def group(self, name: str) -> Path | None:
        return None if self.root is None else self.root / name

    def create(self, name: str, limit_bytes: int) -> Path | None:
        """A cgroup `name` limited to `limit_bytes`; its cgroup.procs for the shim to join. None where limits
        cannot be enforced."""
        group = self.group(name)
        if group is None:
            return None
        self.remove(name)  # one left by an executor that died: its oom_kill count is not this run's
        try:
            group.mkdir(exist_ok=True)
            (group / self.flavour.limit_file).write_text(str(limit_bytes))
        except OSError:
            return None
        return group / "cgroup.procs"

    def oom_killed(self, name: str) -> bool:
        """Whether the kernel killed a process of cgroup `name` for memory."""
        group = self.group(name)
        if group is None:
            return False
        try:
            events = (group / self.flavour.events_file).read_text().splitlines()
        except OSError:
            return False
        return any(line.split()[0] == "oom_kill" and int(line.split()[1]) > 0 for line in events if line.strip())

    def remove(self, name: str) -> None:
        """Remove cgroup `name` once its processes are gone (a cgroup with processes stays)."""
        group = self.group(name)
        if group is not None:
            with contextlib.suppress(OSError):
                group.rmdir()
