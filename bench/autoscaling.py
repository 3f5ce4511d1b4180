"""Autoscaling end to end on the devcluster: the demo's SmolLM2 child, served by Triton + vLLM (CPU build) on
`local-0`, under a load that rises and falls; its HorizontalPodAutoscaler scales it out and back in.

    .venv/bin/python bench/autoscaling.py [--clients N] [--hold 30] [--max-tokens 32] [--calm-tokens 256]
        [--results bench/results/autoscaling.json]

Runs `tailor demo --preset fast` first unless the demo's model is Ready. Then `tailor.devcluster.loadtest`:
clients send requests through the pool's Service (a loopback port spreading connections over the ready
replicas), `--clients` of them (by default enough to fill a replica's batch and queue twice the HPA's target
behind it) until the HPA has added a replica and it answers, `--hold` seconds more; then 4 clients of
`--calm-tokens` requests until the HPA has scaled back to its minimum and the removed replica is gone (drained:
the requests it holds finish); then none. Every figure is measured on this machine: request rate, the HPA's
metric (requests waiting per replica, from the custom metrics API), replicas (HPA desired, Deployment ready), p99
latency and failed requests over time. Writes bench/results/autoscaling.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from kubernetes import config

from tailor.devcluster import cluster, loadtest

ROOT = Path(__file__).resolve().parents[1]
WINDOW_S = 10.0  # rate and p99 over the requests that ended in the last WINDOW_S


def over_time(result: loadtest.LoadTest) -> list[dict[str, float | None]]:
    """Per sample: completed requests/s and p99 latency over the last WINDOW_S, failures so far."""
    rows: list[dict[str, float | None]] = []
    for sample in result.samples:
        ended = sorted(r.seconds for r in result.requests
                       if sample.at - WINDOW_S < r.started + r.seconds <= sample.at and r.error is None)
        rows.append({"at": sample.at, "rate": len(ended) / WINDOW_S,
                     "p99": ended[min(len(ended) - 1, int(0.99 * len(ended)))] if ended else None,
                     "failed": sum(1 for r in result.failed() if r.started + r.seconds <= sample.at)})
    return rows


def plot(result: loadtest.LoadTest, rows: list[dict[str, float | None]], path: Path) -> None:
    at = [s.at for s in result.samples]
    figure, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    axes[0].plot(at, [r["rate"] for r in rows], label="answered")
    axes[0].plot(at, [r["failed"] for r in rows], color="red", label="failed (total)")
    axes[0].set_ylabel("requests/s")
    axes[0].legend(loc="upper right")
    axes[1].plot(at, [s.hpa_average for s in result.samples], label="HPA's average per replica")
    axes[1].plot(at, [sum(s.metric.values()) for s in result.samples], linestyle=":", label="sum over pods")
    axes[1].axhline(result.target, color="grey", linestyle="--", label=f"target {result.target:g}")
    axes[1].set_ylabel(result.metric)
    axes[1].legend(loc="upper right")
    axes[2].step(at, [s.desired_replicas for s in result.samples], where="post", label="HPA desired")
    axes[2].step(at, [s.ready_replicas for s in result.samples], where="post", linestyle="--", label="ready")
    axes[2].set_ylabel("replicas")
    axes[2].set_ylim(0, result.max_replicas + 0.5)
    axes[2].legend(loc="upper right")
    axes[3].plot(at, [r["p99"] for r in rows])
    axes[3].set_ylabel(f"p99 latency (s, {WINDOW_S:.0f}s window)")
    axes[3].set_xlabel("seconds")
    for axis in axes:
        for when in result.events.model_dump(exclude={"in_flight_at_scale_in", "removed_pods"}).values():
            if when is not None:
                axis.axvline(when, color="lightgrey", linewidth=0.8)
    phases = {s.phase: s.at for s in reversed(result.samples)}
    for phase, start in phases.items():
        axes[0].annotate(f"{phase}", (start, 0), textcoords="offset points", xytext=(2, 2), fontsize=8)
    figure.suptitle(f"HPA {result.hpa}: measured on the devcluster ({len(result.requests)} requests, "
                    f"{len(result.failed())} failed)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, help="clients during the surge (default: the replica's "
                                                    "max_num_seqs plus twice the HPA's target)")
    parser.add_argument("--hold", type=float, default=30, help="seconds of surge once the new replica answers")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates")
    parser.add_argument("--calm-tokens", type=int, default=256,
                        help="tokens each request generates while the HPA scales in (the removed replica holds some)")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "autoscaling.json")
    args = parser.parse_args()

    layout = cluster.up()
    api = config.new_client_from_config(config_file=str(layout.kubeconfig))
    if loadtest.demo_model(api) is None:
        subprocess.run([sys.executable, "-m", "tailor.cli.main", "demo", "--preset", "fast"], check=True)
    body = loadtest.demo_model(api)
    if body is None:
        raise SystemExit("the demo's model is not Ready: see `tailor demo`'s output")
    result = loadtest.on_demo_model(api, body, args.hold, args.max_tokens, args.clients, calm_tokens=args.calm_tokens)
    rows = over_time(result)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    report = {"what": "measured on the devcluster: the demo's SmolLM2 child, Triton + vLLM (CPU build)",
              "hold_s": args.hold, "max_tokens": args.max_tokens, "calm_tokens": args.calm_tokens,
              "over_time": rows, **result.model_dump()}
    args.results.write_text(json.dumps(report) + "\n")  # thousands of requests: one line
    plot(result, rows, args.results.with_suffix(".png"))
    events = result.events
    print(f"HPA {result.hpa} on {result.metric} (target {result.target:g} per replica, "
          f"{result.min_replicas}-{result.max_replicas} replicas)")
    for name, when in events.model_dump(exclude={"in_flight_at_scale_in", "removed_pods"}).items():
        print(f"  {name:<22} {'never' if when is None else f'{when:.0f} s'}")
    print(f"  {events.in_flight_at_scale_in} request(s) in flight at the scale-in; removed {events.removed_pods}")
    peak = max((s.hpa_average or 0 for s in result.samples), default=0)
    print(f"  peak {result.metric} {peak:g} per replica; requests {len(result.requests)}, failed "
          f"{len(result.failed())} (during the scale-down {len(result.failed('calm'))})")
    print(f"wrote {args.results} and {args.results.with_suffix('.png')}")
    return 0 if not result.failed() else 1


if __name__ == "__main__":
    sys.exit(main())
