"""What each stage command hands back to the operator: small JSON, written as the Job container's termination
message (`--result-file /dev/termination-log`; Kubernetes keeps at most 4096 bytes of it).

No torch here: the operator parses these with the same models. The compression result carries the child's
config.json (gzip, base64) because the operator sizes deployments from the child's real architecture.
"""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from tailor.compressor.files import write_text

TERMINATION_MESSAGE_BYTES = 4096  # what Kubernetes keeps of /dev/termination-log


class StageResult(BaseModel):
    """Base of the results; `message()` is the JSON that must fit a termination message."""

    def message(self) -> str:
        text = self.model_dump_json()
        if len(text.encode()) > TERMINATION_MESSAGE_BYTES:
            raise ValueError(f"the {type(self).__name__} takes {len(text.encode())} bytes; a termination message "
                             f"holds {TERMINATION_MESSAGE_BYTES}")
        return text


class CompressResult(StageResult):
    """`tailor compress --result-file`: the child's size and architecture."""

    stage: Literal["compress"] = "compress"
    child: str = Field(description="The child's folder, as the Job saw it.")
    params: int
    active_params: int
    parent_params: int
    parent_active_params: int
    pattern: str = Field(description="One code per sub-layer: * attention, M Mamba, - MLP, E MoE, L linear, 0 removed.")
    predicted_speedup: float
    kl_to_parent: float
    config: str = Field(description="The child's config.json, gzip-compressed and base64-encoded.")



def pack_config(config: dict[str, Any]) -> str:
    return base64.b64encode(gzip.compress(json.dumps(config, separators=(",", ":")).encode(), mtime=0)).decode()


def unpack_config(packed: str) -> dict[str, Any]:
    loaded = json.loads(gzip.decompress(base64.b64decode(packed)))
    if not isinstance(loaded, dict):
        raise ValueError("a packed config is not a JSON object")
    return loaded


class QuantizeResult(StageResult):
    """`tailor quantize --result-file`: what was quantized and how big it is."""

    stage: Literal["quantize"] = "quantize"
    checkpoint: str
    recipe: str
    quant_algo: str
    kv_cache_quant_algo: str | None
    weight_bytes: int
    kl_to_unquantized: float | None


class GateResult(StageResult):
    """`tailor evaluate`: the quality gate; mirrors the CompressedModel's status.quality."""

    stage: Literal["evaluate"] = "evaluate"
    metric: Literal["next_token_accuracy"] = "next_token_accuracy"
    parent_score: float
    child_score: float
    retention: float = Field(description="child_score / parent_score")
    min_retention: float
    passed: bool
    parent_perplexity: float
    child_perplexity: float
    kl_to_parent: float
    tokens: int


def write_result(result: StageResult, path: Path) -> None:
    """The result as JSON at `path` (e.g. /dev/termination-log), written whole or not at all."""
    text = result.message()
    if path.is_char_device():  # /dev/termination-log style: no temporary file beside it
        path.write_text(text)
    else:
        write_text(path, text)
