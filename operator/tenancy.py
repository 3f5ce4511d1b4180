"""What a CompressedModel may mount and name: only claims and Secrets it was given.

A PersistentVolumeClaim the spec names (a `pvc://` source, `compression.data.claimName`, `storage.existingClaim`)
is mounted only if it is allowed for Tailor (labelled `tailor.dev/allowed=true`) and is either this object's (a
claim Tailor made carries its object's uid) or shared with it (annotation `tailor.dev/shared-with`: names of
CompressedModels of the namespace, comma-separated, or `*`). Another model's artifacts claim is neither. A
`source.credentialsSecret` must be this object's (`<name>-credentials`) or one the chart shares with every model
(`tenancy.sharedSecrets`): the operator never reads Secrets, so it decides by name.

Pure checks over what `observe` read; `decide.admit` runs them before any Job mounts the claims.
"""

from __future__ import annotations

from typing import Any

from tailor.operator import names
from tailor.operator.conditions import Reason, Refused
from tailor.operator.manifest import owned_by
from tailor.operator.settings import ALLOWED_LABEL, SHARED_ANNOTATION


def shared_with(claim: dict[str, Any], model: str) -> bool:
    """Whether the claim's `tailor.dev/shared-with` names `model` (or every model: `*`)."""
    said = (claim["metadata"].get("annotations") or {}).get(SHARED_ANNOTATION, "")
    return bool({"*", model} & {part.strip() for part in said.split(",")})


def check_claim(claim: dict[str, Any] | None, name: str, field: str, model: dict[str, Any]) -> None:
    """Refused unless the claim `field` names exists, is allowed for Tailor and is this object's or shared
    with it."""
    meta = model["metadata"]
    if claim is None:
        raise Refused(Reason.CLAIM_NOT_ALLOWED, f"{field}: PersistentVolumeClaim {name} does not exist")
    labels = claim["metadata"].get("labels") or {}
    if labels.get(ALLOWED_LABEL) != "true":
        raise Refused(Reason.CLAIM_NOT_ALLOWED, f"{field}: PersistentVolumeClaim {name} is not labelled "
                                                f"{ALLOWED_LABEL}=true (what Tailor may mount is labelled so)")
    if owned_by(claim, meta["uid"]) or shared_with(claim, meta["name"]):
        return
    whose = "holds another CompressedModel's artifacts and " if labels.get(names.MODEL_UID) is not None else ""
    raise Refused(Reason.CLAIM_NOT_ALLOWED, f"{field}: PersistentVolumeClaim {name} {whose}is not shared with "
                                            f"CompressedModel {meta['name']}: annotate it "
                                            f"{SHARED_ANNOTATION}={meta['name']} (or '*' for every model)")


def check_secret(secret: str, model: str, shared: tuple[str, ...]) -> None:
    """Refused unless `secret` is this object's by name or one the chart shares with every model."""
    if secret != names.credentials_secret(model) and secret not in shared:
        allowed = ", ".join([names.credentials_secret(model), *shared])
        raise Refused(Reason.SECRET_NOT_ALLOWED, f"spec.source.credentialsSecret {secret!r} is not this object's "
                                                 f"nor shared by the chart (tenancy.sharedSecrets): use {allowed}")
