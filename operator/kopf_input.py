"""What kopf reads from the API server, bounded, so that nothing a tenant writes can stop the operator: every
answer decoded with `wire.loads`, and its progress records (annotations a tenant can write) checked for their
shape before kopf uses them."""

from __future__ import annotations

import contextlib
import functools
import json
import types
from typing import Any

import aiohttp
import kopf
from kopf._cogs.clients import api as kopf_api
from pydantic import BaseModel, ConfigDict

from tailor.operator import wire

_json_of_response = aiohttp.ClientResponse.json


def read_bounded() -> None:
    """kopf reads lists and watch events with `wire.loads`: its API module's `json.loads` (watch streams) and
    aiohttp's `ClientResponse.json` (lists and single objects), which kopf calls with aiohttp's default decoder.
    Both are kopf's and aiohttp's internals: `test_operator_wire` checks that they are still where this looks."""
    setattr(kopf_api, "json", types.SimpleNamespace(loads=wire.loads, dumps=json.dumps))  # noqa: B010
    aiohttp.ClientResponse.json = functools.partialmethod(  # type: ignore[assignment,method-assign]
        _json_of_response, loads=wire.loads)


class _ProgressRecord(BaseModel):
    """kopf's `ProgressRecord`, as it must be for kopf to use it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    started: str | None = None
    stopped: str | None = None
    delayed: str | None = None
    purpose: str | None = None
    retries: int | None = None
    success: bool | None = None
    failure: bool | None = None
    message: str | None = None
    subrefs: list[str] | None = None


class TenantProgress(kopf.AnnotationsProgressStorage):
    """kopf's progress records in `tailor.dev/` annotations, which a tenant who may edit the object can write too:
    one that is not such a record (not JSON, another shape, nested past `wire.MAX_DEPTH`) reads as none, where
    kopf's own reading would fail the object's worker and stop the operator."""

    def fetch(self, *, key: Any, body: kopf.Body) -> Any:
        annotations = body.get("metadata", {}).get("annotations") or {}
        for full_key in self.make_keys(key, body=body):
            if (encoded := annotations.get(full_key)) is None:
                continue
            with contextlib.suppress(ValueError):  # not JSON, or not a record (ValidationError)
                record = wire.loads(encoded)
                _ProgressRecord.model_validate(record)
                return record
        return None
