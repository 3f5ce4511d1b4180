"""How served speeds are compared (`serving/speed.py`): the CPU used outside a server, and ratios per round."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tailor.compressor.serving.speed import OutsideCpu, Sample, interleaved, ratios


def test_cpu_used_by_another_process_is_counted_and_the_servers_is_not() -> None:
    """A process spinning for 1.5 s adds about a core when it is not the server's, and nothing when it is (the
    two readings share whatever else the machine runs meanwhile)."""
    spin = [sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"]
    server = subprocess.Popen(spin)
    with OutsideCpu(server.pid) as as_server:
        time.sleep(1.7)  # read while it is there (a zombie until waited for)
    server.wait()
    other, idle = subprocess.Popen(spin), subprocess.Popen(["sleep", "3"])
    with OutsideCpu(idle.pid) as as_other:  # a server that does nothing; the spinner is outside it
        time.sleep(1.7)
    other.wait()
    idle.kill()
    idle.wait()
    assert as_other.cores - as_server.cores > 0.6, (as_other.cores, as_server.cores)


def test_models_alternate_and_ratios_pair_rows_of_the_same_round() -> None:
    order: list[str] = []
    speeds = {"parent": 0.02, "child": 0.01}  # seconds per request: the child is twice as fast

    def send_for(model: str) -> object:
        def send(_: int) -> Sample:
            time.sleep(speeds[model])
            return Sample(1, [speeds[model]])

        order.append(model)
        return send

    rows = interleaved(["child", "parent"], send_for, [1], 3, os.getpid(), max_other_cores=64)  # type: ignore[arg-type]
    assert order == ["child", "parent", "parent", "child", "child", "parent"]
    (found,) = ratios(rows, "parent")
    assert found["model"] == "child" and len(found["per_round"]) == 3 and 1.5 < found["ratio"] < 2.5
