"""What the operator is started with (`tailor operator` flags, set by the Helm chart): defaults the spec may
leave out, and the limits a tenant who may create CompressedModels cannot pass."""

from __future__ import annotations

from dataclasses import dataclass, field

from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.operator.api import RUNTIME_IMAGE
from tailor.operator.deployment import SERVING_SERVICE_ACCOUNT, ServingIngress
from tailor.operator.jobs import JOB_SERVICE_ACCOUNT

PROJECT_IMAGES = "ghcr.io/tailor-dev/"
TRITON_IMAGES = "nvcr.io/nvidia/tritonserver:"  # NVIDIA's Triton images: the vLLM pools' engine
# Pod annotations a tenant may set on stage pods: monitoring, autoscaler and queueing hints only. Anything
# else could select privileged behaviour of a webhook or a runtime (e.g. a sidecar injector or AppArmor).
ANNOTATION_PREFIXES = ("prometheus.io/", "cluster-autoscaler.kubernetes.io/", "kueue.x-k8s.io/")
ALLOWED_LABEL = "tailor.dev/allowed"  # a claim a spec names must carry it ("true") for Tailor to mount it
SHARED_ANNOTATION = "tailor.dev/shared-with"  # and be shared with the object: its name, others', or "*"


@dataclass(frozen=True)
class OperatorSettings:
    """Cluster-wide defaults and limits."""

    job_image: str = RUNTIME_IMAGE
    claim_size: str = "1Ti"
    catalog: GpuCatalog = field(default_factory=GpuCatalog.load)
    job_service_account: str = JOB_SERVICE_ACCOUNT
    serving_service_account: str = SERVING_SERVICE_ACCOUNT
    image_pull_secrets: tuple[str, ...] = ()
    image_prefixes: tuple[str, ...] = (PROJECT_IMAGES, TRITON_IMAGES)  # besides job_image itself
    annotation_prefixes: tuple[str, ...] = ANNOTATION_PREFIXES
    priority_classes: tuple[str, ...] = ()  # those a tenant may name; empty: any but system-*
    queue_name: str | None = None  # the Kueue LocalQueue of stage Jobs whose spec names none
    shared_secrets: tuple[str, ...] = ()  # credentials Secrets every object may name (besides <name>-credentials)
    serving_ingress: ServingIngress | None = field(default_factory=lambda: ServingIngress())  # None: no policy

    def image_allowed(self, image: str) -> bool:
        return image == self.job_image or any(image.startswith(prefix) for prefix in self.image_prefixes)

    def annotation_allowed(self, key: str) -> bool:
        return any(key.startswith(prefix) for prefix in self.annotation_prefixes)

    def priority_class_allowed(self, name: str) -> bool:
        return name in self.priority_classes if self.priority_classes else not name.startswith("system-")
