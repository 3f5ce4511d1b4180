"""What the operator is started with (`tailor operator` flags, set by the Helm chart): defaults the spec may
leave out, and the limits a tenant who may create CompressedModels cannot pass."""

from __future__ import annotations

from dataclasses import dataclass, field

from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.operator.allowlists import TenancyLimits
from tailor.operator.api import RUNTIME_IMAGE
from tailor.operator.deployment import SERVING_SERVICE_ACCOUNT, ServingIngress
from tailor.operator.jobs import JOB_SERVICE_ACCOUNT

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
    tenancy: TenancyLimits = field(default_factory=TenancyLimits)  # what a tenant may ask for
    queue_name: str | None = None  # the Kueue LocalQueue of stage Jobs whose spec names none
    gpu_namespaces: tuple[str, ...] = ()  # the only namespaces whose pods hold the pools' GPUs (none: any)
    serving_ingress: ServingIngress | None = field(default_factory=lambda: ServingIngress())  # None: no policy

    def image_allowed(self, image: str) -> bool:
        return image == self.job_image or self.tenancy.image_allowed(image)
