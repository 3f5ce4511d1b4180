"""The devcluster executor's container shim, as containerd's: one per container, it runs the container's command
and owns its processes, so that none outlives the container or the executor, and a restarted executor learns how
the container ended.

`python -m tailor.devcluster.shim PARENT GRACE EXIT_FILE COMMAND [ARG...]`, started by the executor (pid PARENT)
as the leader of a new process group:

- runs COMMAND in that group, as a child subreaper, so that descendants that leave the group (torchrun's workers
  start sessions of their own) are still its descendants;
- on SIGTERM or SIGINT, and when the executor dies (PR_SET_PDEATHSIG), sends SIGTERM to COMMAND alone, as a
  container runtime signals a container's main process (a server's workers stop when it tells them: Triton
  finishes its requests first, which vLLM's engine process given SIGTERM of its own would abort), and SIGKILL to
  every descendant GRACE seconds later: a container's processes never outlive the executor;
- when COMMAND exits, kills what it left behind (as a runtime ends a container with its main process), writes
  its exit code to EXIT_FILE (128 + the signal's number when a signal ended it, as Kubernetes reports it) and
  exits with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
NOT_FOUND = 127  # the shell's exit code for a command it cannot run


def exit_code(returncode: int) -> int:
    """A Popen return code as Kubernetes reports it: 128 + the signal's number for a signal."""
    return 128 - returncode if returncode < 0 else returncode


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state, parent, ...); None for no process or a
    zombie (it has ended)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if not fields or fields[0] in ("Z", "X") else fields


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), to tell it from a later process given the same pid; None
    when it does not run."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def descendants(pid: int) -> list[int]:
    """The running processes below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        if (fields := _stat(stat.parent.name)) is not None:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def kill_tree(pid: int, include_self: bool = True) -> None:
    """SIGKILL to `pid`'s descendants until none runs (a process may fork while its siblings are killed), then to
    `pid`: a subreaper's orphans stay its descendants only while it runs. Nothing is reaped here: a signal
    handler must not take the exit status that `Popen.wait` waits for."""
    for _ in range(50):
        targets = descendants(pid)
        if not targets:
            break
        for target in targets:
            _kill(target, signal.SIGKILL)
        time.sleep(0.02)
    if include_self:
        _kill(pid, signal.SIGKILL)


def _kill(pid: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, number)


def _reap() -> None:
    """Collect the exited children (a subreaper inherits the orphans of its descendants)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _prctl(option: int, value: int) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


def run(parent: int, grace_s: float, exit_file: Path, command: list[str]) -> int:
    """Run `command` as the module's docstring says; its exit code."""
    stopping = False
    process: subprocess.Popen[bytes] | None = None

    def stop(*_: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            if process is not None:
                process.send_signal(signal.SIGTERM)  # nothing once it has been waited for
            signal.alarm(max(1, round(grace_s)))

    def kill(*_: object) -> None:
        kill_tree(os.getpid(), include_self=False)

    signal.signal(signal.SIGALRM, kill)
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, stop)  # a handler, not SIG_IGN, which COMMAND would inherit
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the executor died before PR_SET_PDEATHSIG
        stop()
    code = exit_code(-signal.SIGTERM)
    if not stopping:
        try:
            process = subprocess.Popen(command)
        except OSError as error:
            print(f"cannot run {command[0]}: {error}", file=sys.stderr, flush=True)
            code = NOT_FOUND
        else:
            if stopping:  # told to stop while it started
                process.send_signal(signal.SIGTERM)
            code = exit_code(process.wait())
            signal.alarm(0)
    kill_tree(os.getpid(), include_self=False)  # what COMMAND left behind
    _reap()
    staged = exit_file.with_name(f".{exit_file.name}.tmp")
    staged.write_text(f"{code}\n")
    staged.replace(exit_file)
    return code


def main() -> int:
    parent, grace, exit_file, *command = sys.argv[1:]
    return run(int(parent), float(grace), Path(exit_file), command)


if __name__ == "__main__":
    sys.exit(main())
