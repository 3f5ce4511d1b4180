"""Benchmark the devcluster: cold build (optional), fresh start, restart and stop times.

    .venv/bin/python bench/devcluster.py [--cold-build] [--rounds 3] [--out bench/results/devcluster.json]

`--cold-build` builds every binary with empty Go build and module caches in a temporary folder (about
7 minutes on 2 cores, with downloads from the Go module proxy). The start figures use the normal
cache. Refuses to run while a devcluster is up, since it uses the same ports.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tailor.devcluster import build, cluster


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    started = time.monotonic()
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold-build", action="store_true", help="also time a build with empty Go caches")
    parser.add_argument("--rounds", type=int, default=3, help="fresh start / restart / stop rounds")
    parser.add_argument("--out", type=Path, default=Path("bench/results/devcluster.json"))
    args = parser.parse_args()

    if cluster.running_pid(cluster.Layout(cluster.state_dir()), "kube-apiserver") is not None:
        print("a devcluster is running: stop it first (tailor devcluster down)", file=sys.stderr)
        return 2
    tailor = [sys.executable, "-m", "tailor.cli.main", "devcluster"]
    results: dict[str, object] = {"kubernetes": build.kubernetes_version(), "kwok": build.KWOK_VERSION,
                                  "helm": build.HELM_VERSION, "cpus": os.cpu_count(), "machine": platform.machine()}

    if args.cold_build:
        with tempfile.TemporaryDirectory() as scratch:
            env = {**os.environ, "GOCACHE": f"{scratch}/gocache", "GOMODCACHE": f"{scratch}/gomod",
                   "TAILOR_CACHE_DIR": f"{scratch}/tailor"}
            results["coldBuildSeconds"] = round(timed([*tailor, "build"], env), 1)
            results["coldBuildPeakRssMiB"] = round(
                resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
            subprocess.run(["chmod", "-R", "u+w", scratch], check=True)  # the module cache is read-only
        print(f"cold build: {results['coldBuildSeconds']} s", file=sys.stderr)

    timed([*tailor, "build"])  # the warm cache the start figures use
    fresh, restart, stop = [], [], []
    for _ in range(args.rounds):
        timed([*tailor, "down", "--purge"])
        fresh.append(timed([*tailor, "up"]))     # new certificates, empty etcd, nodes created
        stop.append(timed([*tailor, "down"]))
        restart.append(timed([*tailor, "up"]))   # existing state
        timed([*tailor, "down"])
    timed([*tailor, "down", "--purge"])
    for name, values in (("freshStartSeconds", fresh), ("restartSeconds", restart), ("stopSeconds", stop)):
        results[name] = {"median": round(statistics.median(values), 2), "all": [round(v, 2) for v in values]}
        print(f"{name}: median {results[name]['median']} s over {len(values)}", file=sys.stderr)  # type: ignore[index]

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
