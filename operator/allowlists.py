"""What a tenant who may create CompressedModels may ask for: the chart's `tenancy` values, one definition read
by both enforcers. The chart passes the whole block to the operator (`tailor operator --tenancy`, as JSON) and
renders the same block into its ValidatingAdmissionPolicy, so the two cannot disagree; the defaults here are the
chart's (a test holds `values.yaml` to them). One rule for every list: it allows what it names, and an empty list
allows nothing.
"""

from __future__ import annotations

from pydantic import Field

from tailor.operator.api import ApiModel

PROJECT_IMAGES = "ghcr.io/tailor-dev/"
TRITON_IMAGES = "nvcr.io/nvidia/tritonserver:"  # NVIDIA's Triton images: the vLLM pools' engine
BASE_RESOURCES = ("cpu", "memory", "ephemeral-storage")  # always allowed in spec resources (GPUs are Tailor's)


def _under(key: str, prefixes: list[str]) -> bool:
    return any(key.startswith(prefix) for prefix in prefixes)


class TenancyLimits(ApiModel):
    """The chart's `tenancy` values."""

    allowed_image_prefixes: list[str] = Field(
        default=[PROJECT_IMAGES, TRITON_IMAGES],
        description="Images (besides jobs.image) a CompressedModel may run, by prefix.")
    allowed_annotation_prefixes: list[str] = Field(
        default=["prometheus.io/", "cluster-autoscaler.kubernetes.io/", "kueue.x-k8s.io/"],
        description="Pod annotation keys, by prefix: monitoring, autoscaler and queueing hints. Anything else "
                    "could select privileged behaviour of a webhook or a runtime (a sidecar injector, AppArmor).")
    allowed_pod_label_prefixes: list[str] = Field(
        default=[], description="Pod label keys, by prefix. A label can opt pods into a sidecar injector "
                                "(sidecar.istio.io/inject), another Service's selector or a permissive "
                                "NetworkPolicy: none by default.")
    allowed_toleration_keys: list[str] = Field(
        default=["cloud.google.com/gke-spot", "cloud.google.com/gke-preemptible",
                 "kubernetes.azure.com/scalesetpriority"],
        description="Taint keys the pods may tolerate (exact), besides nvidia.com/gpu, which Tailor tolerates "
                    "itself: spot capacity, never the control plane's or a node's condition taints.")
    allowed_priority_classes: list[str] = Field(
        default=[], description="PriorityClasses the pods may name; none by default (the cluster's default).")
    allowed_extended_resources: list[str] = Field(
        default=["vpc.amazonaws.com/efa", "rdma/ib"],
        description="Resources besides cpu, memory and ephemeral-storage a pod may request (exact names): "
                    "network devices for multi-node jobs, not host devices such as devices.kubevirt.io/kvm.")
    shared_secrets: list[str] = Field(
        default=[], description="Secrets every CompressedModel may name as source.credentialsSecret (e.g. a "
                                "team's HF token); each may always name its own, <name>-credentials.")
    admission_policy: bool = Field(
        default=True, description="Install the ValidatingAdmissionPolicy (Kubernetes 1.30 and later); the "
                                  "operator checks the same either way.")

    def image_allowed(self, image: str) -> bool:
        return _under(image, self.allowed_image_prefixes)

    def annotation_allowed(self, key: str) -> bool:
        return _under(key, self.allowed_annotation_prefixes)

    def pod_label_allowed(self, key: str) -> bool:
        return _under(key, self.allowed_pod_label_prefixes)

    def toleration_allowed(self, key: str) -> bool:
        return key in self.allowed_toleration_keys

    def priority_class_allowed(self, name: str) -> bool:
        return name in self.allowed_priority_classes

    def resource_allowed(self, name: str) -> bool:
        return name in BASE_RESOURCES or name in self.allowed_extended_resources
