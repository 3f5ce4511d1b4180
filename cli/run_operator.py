"""`tailor operator`: run the kopf operator against the current kubeconfig (or in-cluster)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tailor.operator.allowlists import TenancyLimits as TenancyLimits

EXAMPLES = """examples:
  tailor operator --all-namespaces                      # every namespace, metrics on :8080, liveness on :8081
  tailor operator --namespace ml --namespace research   # only these namespaces
  tailor operator --all-namespaces --job-image registry.example.com/tailor:0.1.0 --profiles gpus.yaml
"""


def _operator(args: argparse.Namespace) -> int:
    import kopf
    from prometheus_client import start_http_server

    from tailor.compressor.sizing.hardware import GpuCatalog
    from tailor.operator import handlers
    from tailor.operator.deployment import ServingIngress
    from tailor.operator.settings import OperatorSettings

    kopf.configure(debug=args.verbose, verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    if not args.verbose:  # kopf logs every event handler it runs; keep warnings and errors
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    handlers.configure(OperatorSettings(job_image=args.job_image, claim_size=args.claim_size,
                                        catalog=GpuCatalog.load(args.profiles),
                                        job_service_account=args.job_service_account,
                                        serving_service_account=args.serving_service_account,
                                        image_pull_secrets=tuple(args.image_pull_secret or ()),
                                        tenancy=args.tenancy, queue_name=args.queue_name,
                                        gpu_namespaces=tuple(args.gpu_namespace or ()),
                                        serving_ingress=None if args.no_ingress_policy else ServingIngress(
                                            tuple(args.monitoring_namespace or ServingIngress.monitoring_namespaces),
                                            tuple(args.client_namespace or ()), tuple(args.client_cidr or ()))),
                        namespaces=() if args.all_namespaces else tuple(args.namespace))
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.bind)
    asyncio.run(kopf.operator(
        standalone=True, clusterwide=args.all_namespaces, namespaces=args.namespace or [],
        liveness_endpoint=f"http://{args.bind}:{args.liveness_port}/healthz" if args.liveness_port else None))
    return 0


def _tenancy(text: str) -> TenancyLimits:
    """`--tenancy`: the chart's tenancy values, validated (a wrong key or type names itself)."""
    from pydantic import ValidationError

    from tailor.operator.allowlists import TenancyLimits

    try:
        return TenancyLimits.model_validate_json(text)
    except ValidationError as error:
        raise argparse.ArgumentTypeError(f"not the chart's tenancy values: {error}") from error


def add_parser(nouns: Any) -> None:
    from tailor.operator.allowlists import TenancyLimits
    from tailor.operator.settings import OperatorSettings

    parser = nouns.add_parser("operator", help="run the CompressedModel operator (kopf)", epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("--all-namespaces", action="store_true", help="watch CompressedModels cluster-wide")
    scope.add_argument("--namespace", action="append", help="watch this namespace (repeatable)")
    parser.add_argument("--job-image", default=OperatorSettings.job_image,
                        help="image of the stage Jobs when spec.jobs.image is not set")
    parser.add_argument("--claim-size", default=OperatorSettings.claim_size,
                        help="size of the artifacts claim when spec.storage.size is not set")
    parser.add_argument("--profiles", type=Path, help="YAML file overriding or adding GPU profiles")
    parser.add_argument("--job-service-account", default=OperatorSettings.job_service_account,
                        help="ServiceAccount of the stage Jobs' pods (created per namespace, no API token)")
    parser.add_argument("--serving-service-account", default=OperatorSettings.serving_service_account,
                        help="ServiceAccount of the Triton pods (created per namespace, no API token)")
    parser.add_argument("--image-pull-secret", action="append",
                        help="Secret those ServiceAccounts pull images with (repeatable)")
    parser.add_argument("--tenancy", type=_tenancy, default=TenancyLimits(), metavar="JSON",
                        help="what a tenant may ask for: the chart's tenancy values as JSON, e.g. "
                             "'{\"allowedPriorityClasses\": [\"gpu-batch\"]}'; a key left out keeps the chart's "
                             "default, and an empty list allows nothing")
    parser.add_argument("--monitoring-namespace", action="append",
                        help="namespace of the monitoring stack, which may scrape the Triton pods (repeatable; "
                             "default: monitoring)")
    parser.add_argument("--client-namespace", action="append",
                        help="namespace whose pods may call every model's Triton pods, e.g. a gateway's (repeatable; "
                             "each model's own namespace always may)")
    parser.add_argument("--client-cidr", action="append",
                        help="address range that may call every model's Triton pods, e.g. a load balancer's "
                             "(repeatable)")
    parser.add_argument("--no-ingress-policy", action="store_true",
                        help="create no NetworkPolicy limiting who reaches the Triton pods (their egress stays denied)")
    parser.add_argument("--gpu-namespace", action="append",
                        help="a namespace whose pods may hold the pools' GPUs (repeat): pods are listed only in these "
                             "to count the GPUs left free; none: in every namespace")
    parser.add_argument("--queue-name", help="Kueue LocalQueue of the stage Jobs when spec.jobs.queueName is not set")
    parser.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics port (0: off)")
    parser.add_argument("--liveness-port", type=int, default=8081, help="liveness endpoint port (0: off)")
    parser.add_argument("--verbose", action="store_true", help="debug logging (kopf's too)")
    parser.add_argument("--bind", default="0.0.0.0", help="address of the metrics and liveness endpoints")
    parser.set_defaults(run=_operator)


def _check(args: argparse.Namespace) -> int:
    from tailor.operator.installcheck import check

    problems = check(args.deployment, args.timeout)
    for problem in problems:
        print(f"FAIL {problem}")
    if not problems:
        print(f"ok: the CompressedModel CRD is served and {args.deployment} is available")
    return 1 if problems else 0


def add_check_parser(nouns: Any) -> None:
    parser = nouns.add_parser("operator-check", help="check an installation: CRD served, operator available "
                                                     "(the chart's helm test)")
    parser.add_argument("--deployment", required=True, help="the operator's Deployment, NAMESPACE/NAME")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to keep retrying")
    parser.set_defaults(run=_check)


def _release(args: argparse.Namespace) -> int:
    from tailor.operator.release import run

    released = run(args.stop, None if args.all_namespaces else args.namespace, args.timeout)
    print(f"released {released} CompressedModel(s): deleting one no longer waits for the operator")
    return 0


def add_release_parser(nouns: Any) -> None:
    parser = nouns.add_parser(
        "operator-release", help="stop the operator and remove its finalizer from CompressedModels, so that they "
                                 "can be deleted without it (the chart's pre-delete hook; or after a namespace "
                                 "leaves watchNamespaces)")
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("--all-namespaces", action="store_true", help="every namespace's CompressedModels")
    scope.add_argument("--namespace", action="append", help="this namespace's CompressedModels (repeatable)")
    parser.add_argument("--stop", metavar="NAMESPACE/NAME",
                        help="the operator's Deployment: scaled to zero (and its pods gone) first, or it would add "
                             "the finalizer back")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the operator's pods to go")
    parser.set_defaults(run=_release)
