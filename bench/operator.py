"""Benchmark the operator at fleet scale on a devcluster of its own: 300 simulated GPU nodes (kwok) and 200
CompressedModels whose stage Jobs finish at once (kwok hands back canned results), all created together.

    .venv/bin/python bench/operator.py [--nodes 300] [--models 200] [--out bench/results/operator.json]
    .venv/bin/python bench/operator.py --baseline 4825d2d    # that commit's operator, then this one's, side by side
    .venv/bin/python bench/operator.py --floor               # the floor (bench/floor.py), then this operator
    .venv/bin/python bench/operator.py --floor --repeat 2    # floor, operator, floor, operator: median ratios

Prints and writes: time from create to Ready (p50, p90, p99, max) as seen by a watch, total wall time, the median
time in each stage, Kubernetes API requests the reconciler made per object (the operator's
`tailor_api_requests_total`) and, from the API server's audit log, everything the operator process sent (its
reconciler and kopf, by verb), reconciliation passes per object, the operator's peak resident memory (VmHWM), and
the CPU seconds of the operator and of each devcluster component (where a 2-core machine's time went).
Plots the create-to-Ready distribution. Refuses to run while a devcluster is up: it starts its own in a temporary
state folder on the same ports. With `--baseline REV`, the same run is made first with the operator of commit REV
(a git worktree put first on the operator's PYTHONPATH; the devcluster, CRD and workload stay this checkout's),
then with this checkout's, each on a fresh devcluster; the JSON has both and their ratios. With `--floor`, the
first run is the floor instead: a minimal controller that does only the writes Tailor must do for the same objects
and Jobs (`bench/floor.py`); the ratios say how far Tailor is above it, and the audited requests where they go;
`--repeat N` runs the pair N times, alternating, and gives each pair's ratios and their medians (the JSON's
`floor` and `current` are the first pair's, `pairs` the others').
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config, watch
from prometheus_client.parser import text_string_to_metric_families

from tailor.devcluster import cluster
from tailor.devcluster.simulated import published_results
from tailor.operator import api as model

from baseline import baseline_path, remove_worktree  # bench/baseline.py, beside this script

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "bench"
METRICS_PORT = 18080


def pools_file(folder: Path, nodes: int) -> Path:
    """`nodes` GPU nodes: half H100, a third B200, the rest A100-40GB (8, 8 and 4 GPUs)."""
    h100, b200 = nodes // 2, nodes // 3
    pools = {"pools": [
        {"name": "h100", "count": h100, "cpu": "192", "memory": "2Ti",
         "gpu": {"product": "NVIDIA-H100-80GB-HBM3", "count": 8, "memoryMiB": 81559, "family": "hopper"}},
        {"name": "b200", "count": b200, "cpu": "224", "memory": "4Ti",
         "gpu": {"product": "NVIDIA-B200", "count": 8, "memoryMiB": 183359, "family": "blackwell"}},
        {"name": "a100", "count": nodes - h100 - b200, "cpu": "96", "memory": "1Ti",
         "gpu": {"product": "NVIDIA-A100-SXM4-40GB", "count": 4, "memoryMiB": 40960, "family": "ampere"}}]}
    path = folder / "pools.yaml"
    path.write_text(yaml.safe_dump(pools))
    return path


def manifest(index: int) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "examples" / "nemotron-super-h100.yaml").read_text())
    body["metadata"] = {"name": f"m{index:03d}", "namespace": NAMESPACE}
    spec = body["spec"]
    spec["jobs"]["podAnnotations"] = published_results()  # its 6 x 8 GPUs: the build must fit (pre-flight)
    spec["source"]["credentialsSecret"] = {"name": f"m{index:03d}-credentials"}  # its own
    spec["deployment"]["pools"] = [
        {"name": "h100", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
         "concurrency": {"total": 8}},
        {"name": "b200", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B200"}, "concurrency": {"total": 16}}]
    spec["deployment"].update(minReplicas=1, maxReplicas=2)
    return body


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def scrape(name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=300)
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--baseline", help="a commit whose operator runs first, for a side-by-side comparison")
    parser.add_argument("--floor", action="store_true", help="the floor (bench/floor.py) runs first, side by side")
    parser.add_argument("--repeat", type=int, default=1, help="with --floor: floor and Tailor this many times, "
                        "alternating; the ratios are the medians over the pairs")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "operator.json")
    args = parser.parse_args()
    if cluster.running_pid(cluster.Layout(cluster.state_dir()), "kube-apiserver") is not None:
        print("a devcluster is running: stop it first (tailor devcluster down)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop the benchmark's devcluster

    with tempfile.TemporaryDirectory(prefix="tailor-bench-operator-") as scratch:
        if args.floor:
            pairs = []
            for turn in range(args.repeat):  # floor, Tailor, floor, Tailor...: the machine's drift hits both
                plotted = turn == 0  # the plots are of the pair the JSON's `floor` and `current` are
                floor = bench(args, Path(scratch) / f"floor{turn}", None,
                              args.out.with_name(f"{args.out.stem}-floor.png") if plotted else None, floor=True)
                current = bench(args, Path(scratch) / f"current{turn}", None,
                                args.out.with_suffix(".png") if plotted else None)
                pairs.append({"floor": floor, "current": current, "ratiosToFloor": ratios(floor, current)})
            report = {**pairs[0], "ratiosToFloor": median_ratios([pair["ratiosToFloor"] for pair in pairs])}
            if args.repeat > 1:
                report["pairs"] = [{"floor": without_samples(pair["floor"]), "current": without_samples(
                    pair["current"]), "ratiosToFloor": pair["ratiosToFloor"]} for pair in pairs[1:]]
        elif args.baseline is None:
            report = bench(args, Path(scratch) / "current", None, args.out.with_suffix(".png"))
        else:
            baseline = bench(args, Path(scratch) / "baseline", baseline_path(args.baseline, Path(scratch)),
                             args.out.with_name(f"{args.out.stem}-baseline.png"))
            current = bench(args, Path(scratch) / "current", None, args.out.with_suffix(".png"))
            report = {"baseline": {"commit": args.baseline, **baseline}, "current": current,
                      "ratios": ratios(baseline, current)}
            remove_worktree(Path(scratch))
    report.update(nodes=args.nodes, models=args.models, cpus=os.cpu_count())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(without_samples(report), indent=2))
    return 0


def without_samples(report: dict[str, Any]) -> dict[str, Any]:
    return {key: without_samples(value) if isinstance(value, dict) else value for key, value in report.items()
            if key != "secondsToReady"}


def median_ratios(pairs: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Per figure, the median of its ratio over the pairs (None where a pair has none)."""
    medians: dict[str, float | None] = {}
    for key in pairs[0]:
        values = [pair.get(key) for pair in pairs]
        medians[key] = None if None in values else round(statistics.median(v for v in values if v is not None), 3)
    return medians


def ratios(baseline: dict[str, Any], current: dict[str, Any]) -> dict[str, float | None]:
    """current / baseline for each figure both runs have (below 1: the current operator does better)."""
    def figures(report: dict[str, Any]) -> dict[str, float]:
        out = {f"createToReady.{k}": v for k, v in (report.get("createToReadySeconds") or {}).items()}
        out.update({key: report[key] for key in ("wallSeconds", "apiRequestsPerModel", "reconcilesPerModel",
                                                 "operatorPeakRssMiB") if key in report})
        audit = report["auditedRequestsPerModel"]
        out.update({f"audited.{who}": counts["total"] for who, counts in audit.items()})
        out["audited.all"] = round(sum(counts["total"] for counts in audit.values()), 1)
        cpu = report.get("cpuSeconds") or {}
        out.update({f"cpu.{name}": seconds for name, seconds in cpu.items()})
        out["cpu.all"] = round(sum(cpu.values()), 1)
        return out

    before, after = figures(baseline), figures(current)
    return {key: round(after[key] / before[key], 3) if before.get(key) else None for key in after if key in before}


def bench(args: argparse.Namespace, scratch: Path, pythonpath: Path | None, png: Path | None, floor: bool = False
          ) -> dict[str, Any]:
    """One run on a fresh devcluster of its own, plotted to `png` (None: not plotted); `pythonpath` first on the
    operator's path (a baseline); `floor`: the floor controller (`bench/floor.py`, a process of its own) instead of
    the operator."""
    scratch.mkdir(parents=True, exist_ok=True)
    os.environ["TAILOR_DEVCLUSTER_DIR"] = f"{scratch}/devcluster"
    layout = cluster.up(pools_file(scratch, args.nodes), audit=True)
    controller: subprocess.Popen[bytes] | None = None
    try:
        kubectl = [str(Path(cluster.ensure_binaries()) / "kubectl"), f"--kubeconfig={layout.kubeconfig}"]
        subprocess.run([*kubectl, "apply", "--server-side", "-f", str(REPO / "crds" / "compressedmodel.yaml")],
                       check=True, capture_output=True)
        subprocess.run([*kubectl, "wait", "--for=condition=Established", f"crd/{model.PLURAL}.{model.GROUP}"],
                       check=True, capture_output=True)
        subprocess.run([*kubectl, "create", "namespace", NAMESPACE], check=True, capture_output=True)
        env = {**os.environ, "KUBECONFIG": str(layout.kubeconfig)}
        if floor:
            command = [sys.executable, str(REPO / "bench" / "floor.py"), "--kubeconfig", str(layout.kubeconfig),
                       "--namespace", NAMESPACE]
        else:
            # kwok finishes the stage Jobs with results from devcluster.tailor.dev/ pod annotations, which the
            # operator allows only when told: as --tenancy now, by an older flag before, not at all before that
            cli = (pythonpath / "tailor" if pythonpath else REPO) / "cli" / "run_operator.py"
            said = cli.read_text() if cli.exists() else ""
            allow = (["--tenancy", json.dumps({"allowedAnnotationPrefixes": ["devcluster.tailor.dev/"]})]
                     if "--tenancy" in said else ["--allowed-annotation-prefix", "devcluster.tailor.dev/"]
                     if "--allowed-annotation-prefix" in said else [])
            if pythonpath is not None:
                env["PYTHONPATH"] = str(pythonpath)
            command = [sys.executable, "-m", "tailor.cli.main", "operator", "--namespace", NAMESPACE,
                       "--metrics-port", str(METRICS_PORT), "--liveness-port", "0", "--bind", "127.0.0.1", *allow]
        with (scratch / "controller.log").open("wb") as sink:
            controller = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
        time.sleep(3)
        report = run(layout, args, controller, png, floor)
        report["auditedRequestsPerModel"] = audited(layout.audit_log, args.models)
    finally:
        if controller is not None:
            controller.terminate()
            controller.wait(timeout=60)
        cluster.down(purge=True)
    return report


def run(layout: cluster.Layout, args: argparse.Namespace, controller: subprocess.Popen[bytes], png: Path | None,
        floor: bool) -> dict[str, Any]:
    api = config.new_client_from_config(config_file=str(layout.kubeconfig))
    objects = client.CustomObjectsApi(api)
    ready: dict[str, float] = {}
    created: dict[str, float] = {}
    done = threading.Event()

    def watch_ready() -> None:
        """Until every object is Ready or the time is up; a watch the API server closes (a slow watcher is cut
        off under load) is opened again, listing what is there first."""
        deadline = time.monotonic() + args.timeout
        while len(ready) < args.models and (left := deadline - time.monotonic()) > 1:
            stream = watch.Watch()
            for event in stream.stream(objects.list_namespaced_custom_object, model.GROUP, model.API_VERSION, NAMESPACE,
                                       model.PLURAL, timeout_seconds=int(left)):
                item = event["object"]
                name = item["metadata"]["name"]
                if (item.get("status") or {}).get("phase") == "Ready" and name not in ready:
                    ready[name] = time.monotonic()
                    if len(ready) == args.models:
                        stream.stop()
        done.set()

    watcher = threading.Thread(target=watch_ready, daemon=True)
    watcher.start()
    started = time.monotonic()
    for index in range(args.models):
        body = manifest(index)
        created[body["metadata"]["name"]] = time.monotonic()
        objects.create_namespaced_custom_object(model.GROUP, model.API_VERSION, NAMESPACE, model.PLURAL, body)
    print(f"created {args.models} CompressedModels in {time.monotonic() - started:.1f} s", file=sys.stderr)
    last_report = time.monotonic()
    while not done.wait(5):
        if time.monotonic() - last_report > 30:
            print(f"{len(ready)}/{args.models} Ready after {time.monotonic() - started:.0f} s", file=sys.stderr)
            last_report = time.monotonic()
    seconds = [ready[name] - created[name] for name in ready]
    report: dict[str, Any] = {
        "ready": len(ready), "wallSeconds": round(max(ready.values(), default=started) - started, 1),
        "createToReadySeconds": {"p50": round(statistics.median(seconds), 2), "p90": round(percentile(seconds, 0.9), 2),
                                 "p99": round(percentile(seconds, 0.99), 2), "max": round(max(seconds), 2)}
        if seconds else None,
        "secondsToReady": sorted(round(s, 2) for s in seconds)}
    peak_kib = next(int(line.split()[1]) for line in Path(f"/proc/{controller.pid}/status").read_text()
                    .splitlines() if line.startswith("VmHWM"))
    report["operatorPeakRssMiB"] = round(peak_kib / 1024, 1)
    report["cpuSeconds"] = cpu_seconds(layout, controller.pid)
    report["apiServer"] = api_server_costs(api)
    if not floor:  # the floor keeps no metrics and no stages
        requests, passes = scrape("tailor_api_requests_total"), scrape("tailor_reconciles_total")
        report.update(apiRequestsPerModel=round(requests / args.models, 1),
                      reconcilesPerModel=round(passes / args.models, 1), stageSecondsMedian=stage_seconds(objects))
    if png is not None:
        plot(seconds, png)
    return report


def cpu_seconds(layout: cluster.Layout, controller: int) -> dict[str, float]:
    """CPU seconds (user + system) each process has used since it started: the controller (operator or floor)
    and each devcluster component, read from /proc at the end of the run; on a machine this small they share its
    cores, so what one uses the others wait for."""
    pids = {"controller": controller, **{name: pid for name in cluster.COMPONENTS
                                         if (pid := cluster.running_pid(layout, name)) is not None}}
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended since: the ratios leave it out
            continue
        found[name] = round((int(fields[11]) + int(fields[12])) / ticks, 1)  # utime, stime
    return found


def api_server_costs(api: client.ApiClient, top: int = 12) -> dict[str, Any]:
    """Where the API server's time went, from its own metrics at the end of the run (every client, not only the
    controller): the `top` request kinds by summed latency (verb resource[/subresource]: count, seconds), and the
    watch events it sent per resource (count, MB encoded; once per watcher)."""
    method, url, headers, _, _ = api.param_serialize("GET", "/metrics", auth_settings=["BearerToken"],
                                                     header_params={"Accept": "text/plain"})
    text = api.call_api(method, url, header_params=headers).response.data.decode()
    requests: dict[str, list[float]] = {}
    watched: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name in ("apiserver_request_duration_seconds_sum", "apiserver_request_duration_seconds_count"):
                if labels.get("verb") in ("WATCH", "CONNECT"):
                    continue  # a watch's latency is how long it stayed open
                key = f"{labels.get('verb')} {labels.get('resource')}" + (
                    f"/{labels['subresource']}" if labels.get("subresource") else "")
                slot = requests.setdefault(key, [0.0, 0.0])
                slot[0 if sample.name.endswith("_count") else 1] += sample.value
            elif sample.name in ("apiserver_watch_events_total", "apiserver_watch_events_sizes_sum"):
                slot = watched.setdefault(labels.get("resource") or labels.get("kind", "?"), [0.0, 0.0])
                slot[0 if sample.name == "apiserver_watch_events_total" else 1] += sample.value
    ranked = sorted(requests.items(), key=lambda item: -item[1][1])[:top]
    return {"requestsByLatency": {key: {"count": int(count), "seconds": round(seconds, 1)}
                                  for key, (count, seconds) in ranked},
            "watchEvents": {key: {"count": int(count), "MB": round(size / 1e6, 1)}
                            for key, (count, size) in sorted(watched.items(), key=lambda item: -item[1][1])[:top]}}


def audited(log: Path, models: int) -> dict[str, Any]:
    """Requests the API server logged from the controller, per model: the operator's reconciler (user agent
    tailor-operator/...) and kopf (kopf/...: watches, finalizers, its annotations), or the floor (tailor-floor/...),
    by verb, and its writes (create, patch, update, delete) by resource."""
    counts: dict[str, dict[str, int]] = {"reconciler": {}, "kopf": {}, "floor": {}}
    writes: dict[str, dict[str, int]] = {who: {} for who in counts}
    with log.open() as lines:
        for line in lines:
            entry = json.loads(line)
            agent = entry.get("userAgent", "")
            who = ("reconciler" if agent.startswith("tailor-operator/") else
                   "kopf" if agent.startswith("kopf/") else "floor" if agent.startswith("tailor-floor/") else None)
            if who is None:
                continue
            verb = entry["verb"]
            counts[who][verb] = counts[who].get(verb, 0) + 1
            if verb in ("create", "patch", "update", "delete"):
                ref = entry.get("objectRef", {})
                key = f"{verb} {ref.get('resource', '?')}{'/' + ref['subresource'] if ref.get('subresource') else ''}"
                writes[who][key] = writes[who].get(key, 0) + 1
    return {who: {"total": round(sum(verbs.values()) / models, 1),
                  **{verb: round(n / models, 1) for verb, n in sorted(verbs.items())},
                  "writes": {key: round(n / models, 2) for key, n in sorted(writes[who].items())}}
            for who, verbs in counts.items() if verbs}


def stage_seconds(objects: client.CustomObjectsApi) -> dict[str, float]:
    """Median seconds per stage (status.stages startedAt to completedAt; the API keeps whole seconds), and from
    creation to the first stage's start."""
    import datetime

    def at(text: str) -> float:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()

    spans: dict[str, list[float]] = {}
    for item in objects.list_namespaced_custom_object(model.GROUP, model.API_VERSION, NAMESPACE, model.PLURAL)["items"]:
        stages = (item.get("status") or {}).get("stages", [])
        if stages and stages[0].get("startedAt"):
            spans.setdefault("createToFirstStage", []).append(at(stages[0]["startedAt"]) -
                                                               at(item["metadata"]["creationTimestamp"]))
        for stage in stages:
            if stage.get("startedAt") and stage.get("completedAt"):
                spans.setdefault(stage["name"], []).append(at(stage["completedAt"]) - at(stage["startedAt"]))
    return {name: round(statistics.median(values), 1) for name, values in spans.items()}


def plot(seconds: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    axes.hist(seconds, bins=30)
    axes.set_xlabel("seconds from create to Ready")
    axes.set_ylabel("CompressedModels")
    axes.set_title(f"{len(seconds)} CompressedModels, stage Jobs finished by kwok")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
