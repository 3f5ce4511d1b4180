"""What each stage command hands back to the operator: small JSON, written as the Job container's termination
message (`--result-file /dev/termination-log`; Kubernetes keeps at most 4096 bytes of it).

No torch here: the operator parses these with the same models. The compression result carries the child's
config.json (gzip, base64) because the operator sizes deployments from the child's real architecture.

A result comes from a pod, so the operator treats it as untrusted input: every field is bounded here and a
packed config is decompressed to at most `MAX_CONFIG_BYTES`.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tailor.compressor.files import write_text

TERMINATION_MESSAGE_BYTES = 4096  # what Kubernetes keeps of /dev/termination-log
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB; more is not a config
MAX_PARAMS = 10**14
MAX_JSON_DEPTH = 64  # a config.json nests 3 or 4 levels
MAX_CODE_FILES = 24  # a package's repositories hold one or two models, each with four or five code files
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
BRACKETS = re.compile(r"[\[\]{}]")
Score = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Positive = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]


class StageResult(BaseModel):
    """Base of the results; `message()` is the JSON that must fit a termination message."""

    model_config = ConfigDict(extra="forbid")

    simulated: str | None = Field(None, max_length=512,
                                  description="What produced this result when no stage computed it (the "
                                              "devcluster's canned figures); None for a real run.")

    def message(self) -> str:
        text = self.model_dump_json()
        if len(text.encode()) > TERMINATION_MESSAGE_BYTES:
            raise ValueError(f"the {type(self).__name__} takes {len(text.encode())} bytes; a termination message "
                             f"holds {TERMINATION_MESSAGE_BYTES}")
        return text


class CompressResult(StageResult):
    """`tailor compress --result-file`: the child's size and architecture."""

    stage: Literal["compress"] = "compress"
    child: str = Field(max_length=1024, description="The child's folder, as the Job saw it.")
    params: int = Field(ge=1, le=MAX_PARAMS)
    active_params: int = Field(ge=1, le=MAX_PARAMS)
    parent_params: int = Field(ge=1, le=MAX_PARAMS)
    parent_active_params: int = Field(ge=1, le=MAX_PARAMS)
    pattern: str = Field(max_length=TERMINATION_MESSAGE_BYTES, pattern=r"^[*ME\-L0]*$",
                         description="One code per sub-layer: * attention, M Mamba, - MLP, E MoE, L linear, 0 removed.")
    predicted_speedup: Positive
    measured_speedup: Positive | None = Field(None, description="Decode tokens/s of the child over the parent, "
                                                                "measured in the Job; None where not measured.")
    kl_to_parent: Positive
    compute: str | None = Field(None, max_length=512, description="The dtype the Job computed in, and why "
                                                                   "(`compute.Compute.describe`).")
    config: str = Field(max_length=TERMINATION_MESSAGE_BYTES,
                        description="The child's config.json, gzip-compressed and base64-encoded.")


def pack_config(config: dict[str, Any]) -> str:
    compressor = zlib.compressobj(wbits=31)  # the gzip container
    packed = compressor.compress(json.dumps(config, separators=(",", ":")).encode()) + compressor.flush()
    return base64.b64encode(packed).decode()


def bounded_json(text: str, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads(text)` once its nesting is known to be at most `max_depth` (deeper JSON would exhaust the
    parser's recursion); a ValueError naming `what` otherwise."""
    depth = deepest = 0
    for bracket in BRACKETS.finditer(STRINGS.sub('""', text)):
        depth += 1 if bracket[0] in "[{" else -1
        deepest = max(deepest, depth)
        if deepest > max_depth:
            raise ValueError(f"{what} nests deeper than {max_depth} levels")
    return json.loads(text)


def unpack_config(packed: str) -> dict[str, Any]:
    """The config a result carries; a ValueError for anything else, including more than MAX_CONFIG_BYTES."""
    try:
        stream = zlib.decompressobj(wbits=31)
        text = stream.decompress(base64.b64decode(packed, validate=True), MAX_CONFIG_BYTES)
        if stream.unconsumed_tail or not stream.eof:
            raise ValueError(f"the packed config is incomplete or above {MAX_CONFIG_BYTES} bytes")
        loaded = bounded_json(text.decode(), "the packed config")
    except (binascii.Error, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"the packed config is not gzip-compressed JSON in base64: {error}") from error
    if not isinstance(loaded, dict):
        raise ValueError("a packed config is not a JSON object")
    return loaded


class QuantizeResult(StageResult):
    """`tailor quantize --result-file`: what was quantized and how big it is."""

    stage: Literal["quantize"] = "quantize"
    checkpoint: str = Field(max_length=1024)
    recipe: str = Field(max_length=64)
    quant_algo: str = Field(max_length=64)
    kv_cache_quant_algo: Literal["FP8"] | None
    weight_bytes: int = Field(ge=1, le=MAX_PARAMS * 2)
    kl_to_unquantized: Positive | None


class GateResult(StageResult):
    """`tailor evaluate`: the quality gate; mirrors the CompressedModel's status.quality."""

    stage: Literal["evaluate"] = "evaluate"
    metric: Literal["next_token_accuracy"] = "next_token_accuracy"
    parent_score: Score
    child_score: Score
    retention: Positive = Field(description="child_score / parent_score")
    min_retention: Score
    passed: bool = Field(description="The pod's verdict; the operator decides the gate from the scores itself.")
    parent_perplexity: Positive
    child_perplexity: Positive
    kl_to_parent: Positive
    tokens: int = Field(ge=1, le=10**10)


class SpeedRatio(BaseModel):
    """The child's tokens/s over the parent's at one concurrency: the median over rounds."""

    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(ge=1, le=4096)
    ratio: Positive
    per_round: list[Positive] = Field(max_length=16)
    contended: bool = Field(description="A row behind it was taken while other processes used the CPU.")


class SpeedResult(StageResult):
    """`tailor speed`: the child's served tokens/s over its parent's, both in one tritonserver with the same
    engine arguments, measured interleaved; or why it was not measured (`skipped`)."""

    stage: Literal["speed"] = "speed"
    engine: Literal["vllm"] = "vllm"
    dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="What the engine computed in.")
    gpu: str = Field(max_length=64)
    context: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    new_tokens: int = Field(ge=1)
    rounds: int = Field(ge=0, le=16)
    ratios: list[SpeedRatio] = Field(default_factory=list, max_length=16)
    skipped: str | None = Field(None, max_length=1024)


CodePath = Annotated[str, Field(max_length=512, pattern=r"^[A-Za-z0-9_+=@-][A-Za-z0-9._/+=@-]*$")]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class PackageResult(StageResult):
    """`tailor package --plan --result-file`: the SHA-256 of each file that decides what code the served model
    runs (`serving.codecheck`), by its path under the claim's root; every Triton container checks them."""

    stage: Literal["package"] = "package"
    code: dict[CodePath, Sha256] = Field(max_length=MAX_CODE_FILES)

    @model_validator(mode="after")
    def _complete(self) -> PackageResult:
        if any(".." in path.split("/") for path in self.code):
            raise ValueError("a code path leaves the claim ('..')")
        if not self.code and self.simulated is None:
            raise ValueError("no code digests: a package holds at least its model.py and config.pbtxt")
        return self

    def under(self, folder: str) -> dict[str, str] | None:
        """The digests of the code in `folder` (relative to the claim's root); None for a simulated package, whose
        pods kwok runs (nothing to check)."""
        if self.simulated is not None:
            return None
        return {path: digest for path, digest in self.code.items() if path.startswith(f"{folder}/")}


def write_result(result: StageResult, path: Path) -> None:
    """The result as JSON at `path` (e.g. /dev/termination-log), written whole or not at all."""
    text = result.message()
    if path.is_char_device():  # /dev/termination-log style: no temporary file beside it
        path.write_text(text)
    else:
        write_text(path, text)
