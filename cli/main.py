"""The `tailor` command: noun/verb subcommands; data on stdout, progress and errors on stderr."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tailor.cli import compress, demo, generated, plans, quantize, run_operator, runtime, serving, size

DEVCLUSTER_EXAMPLES = """examples:
  tailor devcluster build                    # build the pinned binaries once (cold: tens of minutes)
  tailor devcluster up                       # build if needed and start; creates the GPU node pools
  tailor devcluster up --no-metrics          # without Prometheus and prometheus-adapter (HPAs read <unknown>)
  tailor devcluster up --kueue               # with Kueue, to queue stage Jobs (spec.jobs.queueName)
  export KUBECONFIG=$(tailor devcluster kubeconfig)
  eval "$(tailor devcluster env)"            # KUBECONFIG plus kubectl and helm on PATH
  tailor devcluster status --json
  tailor devcluster down --purge             # stop and delete the cluster's data
"""

CRD_EXAMPLES = """examples:
  tailor crd generate            # rewrite the CRD (crds/ and the chart's crds/) and docs/reference/compressedmodel.md
  tailor crd generate --check    # exit 1 if any of them is out of date
  tailor crd generate --stdout | kubectl apply -f -
"""


def _devcluster(args: argparse.Namespace) -> int:
    from tailor.devcluster import build, cluster, nodes

    if args.verb == "build":
        print(build.ensure_binaries())
        if not args.no_metrics:
            print(build.ensure_metrics_binaries())
        if args.kueue:
            print(build.ensure_kueue_binaries())
        if args.registry:
            print(build.ensure_registry_binaries())
    elif args.verb == "up":
        cluster.up(args.pools or nodes.DEFAULT_POOLS_FILE, metrics_pipeline=not args.no_metrics,
                   queueing=args.kueue)
    elif args.verb == "down":
        cluster.down(purge=args.purge)
    elif args.verb == "status":
        report = cluster.status()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            for name, component in report["components"].items():
                state = f"running (pid {component['pid']})" if component["running"] else "stopped"
                print(f"{name:<24} {state}")
            if "serverVersion" in report:
                print(f"{'server version':<24} {report['serverVersion']}")
                print(f"{'nodes ready':<24} {report['nodes']['ready']}/{report['nodes']['total']}")
        return 0 if all(c["running"] for c in report["components"].values() if c["expected"]) else 3
    elif args.verb == "kubeconfig":
        print(cluster.Layout(cluster.state_dir()).kubeconfig)
    elif args.verb == "env":
        print(f"export KUBECONFIG={cluster.Layout(cluster.state_dir()).kubeconfig}")
        print(f'export PATH={build.ensure_binaries()}:"$PATH"')
    return 0


def _crd(args: argparse.Namespace) -> int:
    from tailor.operator import crd

    if args.stdout:
        sys.stdout.write(crd.render_crd())
        return 0
    return _generate(crd.generated(), args.check, "tailor crd generate")


def _docs(args: argparse.Namespace) -> int:
    return _generate(generated.docs(build_parser()), args.check, "tailor docs generate")


def _generate(files: dict[Path, str], check: bool, command: str) -> int:
    """Write generated files, or with `check` name those out of date (exit 1)."""
    if check:
        for path in generated.stale(files):
            print(f"{path} is out of date: run `{command}`", file=sys.stderr)
        return 1 if generated.stale(files) else 0
    for path in generated.write(files):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailor", description="Compress, quantize and serve LLMs on Kubernetes.")
    nouns = parser.add_subparsers(dest="noun", required=True)

    devcluster = nouns.add_parser(
        "devcluster", help="a real local control plane with simulated GPU node pools",
        epilog=DEVCLUSTER_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = devcluster.add_subparsers(dest="verb", required=True)
    no_metrics = argparse.ArgumentParser(add_help=False)
    no_metrics.add_argument("--no-metrics", action="store_true",
                            help="without the metrics pipeline (Prometheus, prometheus-adapter)")
    no_metrics.add_argument("--kueue", action="store_true", help="with Kueue (its manager and CRDs), to queue stage "
                                                                "Jobs")
    build_verb = verbs.add_parser("build", parents=[no_metrics],
                                  help="build the binaries from Go modules unless cached; print their folders")
    build_verb.add_argument("--registry", action="store_true",
                            help="also the OCI registry (CNCF distribution) the chart is published to in tests")
    up = verbs.add_parser("up", parents=[no_metrics], help="build if needed, start etcd, apiserver, controllers, "
                                                           "scheduler, kwok, the executor, Prometheus and the adapter")
    up.add_argument("--pools", type=Path, help="node pools YAML (default: devcluster/nodepools.yaml)")
    down = verbs.add_parser("down", help="stop everything `up` started")
    down.add_argument("--purge", action="store_true", help="also delete the cluster's data and certificates")
    status = verbs.add_parser("status", help="which components run; server version and node readiness")
    status.add_argument("--json", action="store_true", help="print a JSON report")
    verbs.add_parser("kubeconfig", help="print the path of the admin kubeconfig")
    verbs.add_parser("env", help="print shell exports for KUBECONFIG and the kubectl/helm binaries")
    devcluster.set_defaults(run=_devcluster)

    crd = nouns.add_parser("crd", help="the CompressedModel CustomResourceDefinition", epilog=CRD_EXAMPLES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    crd_verbs = crd.add_subparsers(dest="verb", required=True)
    generate = crd_verbs.add_parser(
        "generate",
        help="write the CRD (crds/, charts/tailor/crds/) and docs/reference/compressedmodel.md from the models")
    mode = generate.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when a generated file differs from the models")
    mode.add_argument("--stdout", action="store_true", help="print instead of writing")
    crd.set_defaults(run=_crd)

    docs = nouns.add_parser("docs", help="the documentation site's generated reference pages")
    docs_verbs = docs.add_subparsers(dest="verb", required=True)
    docs_generate = docs_verbs.add_parser(
        "generate", help="write docs/reference/cli.md (from this command) and docs/reference/chart-values.md (from "
                         "the chart's values.yaml and values.schema.json)")
    docs_generate.add_argument("--check", action="store_true",
                               help="exit 1 when a generated page differs from its source")
    docs.set_defaults(run=_docs)

    size.add_parser(nouns)
    demo.add_parser(nouns)
    compress.add_parsers(nouns)
    quantize.add_parser(nouns)
    serving.add_parsers(nouns)
    runtime.add_parser(nouns)
    plans.add_parser(nouns)
    run_operator.add_parser(nouns)
    run_operator.add_check_parser(nouns)
    run_operator.add_release_parser(nouns)
    return parser


# oneDNN, torch's CPU BF16 kernels, keeps up to 1024 compiled kernels, one per shape. A MoE's experts see new token
# counts at every training step, so new shapes: 300 of them on one BF16 linear peaked 0.39 GiB higher at the
# default than at 64, and fixed shapes build the same kernels at either capacity (`bench/kernel_cache.py`). Read
# when the first kernel is built; a user's own setting wins.
KERNEL_CACHE = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault(*KERNEL_CACHE)
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (RuntimeError, ValueError) as error:
        print(f"tailor: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
