"""The build plan: every decision about one CompressedModel build, made once by the operator and read by each
stage Job (`tailor compress|quantize|evaluate|package --plan plan.yaml`). No Job re-derives anything: the
precision, the KV-cache dtype, the GPU profiles in force, the paths on the artifacts claim and, for a
package Job, its pool's sizing and vLLM engine arguments are all here. No torch.

Layout of the artifacts claim (`ArtifactLayout`), per object `<name>-<uid8>`:

    <folder>/g<build>/compress/child         the Puzzle child (BF16)
    <folder>/g<build>/quantized              the exported quantized checkpoint
    <folder>/g<build>/results/<stage>.json   each stage's result, also kept beside the artifacts
    <folder>/g<generation>/triton-<pool>/repository   a pool's model repository
    <folder>/g<generation>/speed-<pool>/repository    parent and child side by side (`tailor speed`)
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from tailor.compressor.puzzle.plan import Plan, PlanError, problems
from tailor.compressor.sizing.concurrency import Sizing
from tailor.compressor.sizing.engines import MAX_BATCH_CAP, Engine
from tailor.compressor.sizing.hardware import GpuCatalog, GpuProfile, Precision
from tailor.compressor.sizing.memory import KvDtype

# libyaml's emitter and parser where PyYAML has them (several times the pure-Python ones: the operator writes a plan
# per build and per pool, and reads each once)
DUMPER: type[yaml.SafeDumper] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

API_VERSION: Literal["tailor.dev/build-plan/v1"] = "tailor.dev/build-plan/v1"
PLAN_FILE = "plan.yaml"
ARTIFACTS_MOUNT = "/artifacts"  # the claim, in stage pods
MODELS_MOUNT = "/models"  # the claim, read-only, in Triton pods
SOURCE_MOUNT = "/source"  # a pvc:// parent's claim, read-only, in stage pods
DATA_MOUNT = "/data"  # the claim of spec.compression.data, read-only, in the build stages' pods
PLAN_MOUNT = "/plan"  # the plan ConfigMap, in stage pods
REPOSITORY = "repository"  # the model repository inside a `tailor package` folder
Stage = Literal["compress", "quantize", "evaluate", "package", "speed"]
BUILD_STAGES: tuple[Stage, ...] = ("compress", "quantize", "evaluate")
# The stages whose code splits its work across torchrun's ranks (one per GPU, on any number of nodes); every other
# stage is one process: quantization and evaluation stream the model a layer at a time on one GPU, packaging and
# the speed client use none (`tailor.cli.plans.one_process` refuses to run as a rank).
DISTRIBUTED_STAGES: frozenset[Stage] = frozenset({"compress"})
ONE_GPU_STAGES: frozenset[Stage] = frozenset({"quantize", "evaluate"})


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class ArtifactLayout(_Model):
    """Where every stage reads and writes on the artifacts claim."""

    root: str = Field(ARTIFACTS_MOUNT, description="Where the artifacts claim is mounted in stage pods.")
    folder: str = Field(pattern=r"^[a-z0-9][-a-z0-9]*$", description="The object's folder: <name>-<uid8>.")
    build: int = Field(ge=1, description="The generation whose Jobs build the artifacts.")
    keep: list[int] = Field(default_factory=list, description="Generations whose folders outlive this build (every "
                            "one a revision reads, and the last build that passed its gate); every other g<N> folder "
                            "of the object is removed when the build starts.")

    @property
    def build_dir(self) -> str:
        return f"{self.root}/{self.folder}/g{self.build}"

    @property
    def compress_dir(self) -> str:
        return f"{self.build_dir}/compress"

    @property
    def child(self) -> str:
        return f"{self.compress_dir}/child"

    @property
    def quantized(self) -> str:
        return f"{self.build_dir}/quantized"

    @property
    def cache(self) -> str:
        """Downloads (hf:// parents), shared by the object's stages and builds."""
        return f"{self.root}/.cache"

    def result(self, stage: Stage) -> str:
        return f"{self.build_dir}/results/{stage}.json"

    def package(self, generation: int, pool: str) -> str:
        """A pool's `tailor package` folder, relative to the claim's root (Triton pods mount the claim elsewhere)."""
        return f"{self.folder}/g{generation}/triton-{pool}"

    def speed(self, generation: int, pool: str) -> str:
        """The parent and child packaged side by side for `tailor speed`, relative to the claim's root."""
        return f"{self.folder}/g{generation}/speed-{pool}"

    def prune(self) -> list[Path]:
        """The retention policy: a build removes the object's older generation folders (builds and packages),
        keeping its own and those in `keep`; the removed folders."""
        kept = {f"g{generation}" for generation in (self.build, *self.keep)}
        found = sorted(Path(self.root, self.folder).glob("g*"))
        stale = [path for path in found if path.is_dir() and re.fullmatch(r"g\d+", path.name) and path.name not in kept]
        for path in stale:
            shutil.rmtree(path)
        return stale


class QuantizeStep(_Model):
    format: Literal["nvfp4", "fp8"]
    calibration_tokens: int = Field(ge=16)
    eval_tokens: int = Field(ge=16)


class EvaluateStep(_Model):
    min_retention: float = Field(gt=0, le=1, description="The floor the operator gates at (the evaluate pod's own "
                                 "verdict is not trusted); a generation that changes only the floor gets the build's "
                                 "plan with its own.")
    eval_tokens: int = Field(ge=16)


def repository_in_pod(package_folder: str) -> str:
    """The model repository of a package folder, where a Triton pod mounts the artifacts claim."""
    return f"{MODELS_MOUNT}/{package_folder}/{REPOSITORY}"


class PoolServing(_Model):
    """What a package Job writes for one pool: sized by the operator from the quantize result and the nodes."""

    name: str
    generation: int = Field(ge=1)
    gpu_profile: str
    context: int = Field(ge=1)
    tensor_parallel: int = Field(ge=1)
    max_batch_size: int = Field(ge=1, le=MAX_BATCH_CAP)
    engine: Engine = Engine.VLLM
    quantized: bool = Field(True, description="Serve the quantized checkpoint; false: the BF16 child (where the "
                                              "pool's engine cannot run the quantized one).")
    sizing: Sizing
    engine_args: dict[str, Any] | None = Field(None, description="vLLM's engine arguments, which the package Job "
                                               "writes into model.json as they are (`engines.engine_args`, as "
                                               "the revision's annotation shows them); none for the Python engine.")
    measure_speedup: bool = Field(False, description="Also package the BF16 child and the parent side by side "
                                                     "for the served speed-up (`tailor speed`).")

    @model_validator(mode="after")
    def _engine_args_for_vllm(self) -> PoolServing:
        """vLLM pools carry their engine arguments; the Python engine has none."""
        if (self.engine is Engine.VLLM) != (self.engine_args is not None):
            raise ValueError(f"engine {self.engine.value} with{'out' if self.engine_args is None else ''} "
                             "engine arguments")
        return self


class BuildPlan(_Model):
    """One build, resolved."""

    api_version: Literal["tailor.dev/build-plan/v1"] = API_VERSION
    model: str = Field(description="The name the model is served under (the CompressedModel's).")
    fingerprint: str
    parent: str = Field(description="The parent as a stage pod sees it (a folder or an hf:// URI).")
    target_gpu: str
    target_product: str = Field(description="nvidia.com/gpu.product of the nodes the build runs on.")
    precision: Precision = Field(description="Weights of the served checkpoint; bf16 means no quantize stage.")
    kv_cache_dtype: KvDtype
    gpu_profiles: list[GpuProfile] = Field(description="Every GPU profile in force (built-in and the chart's).")
    layout: ArtifactLayout
    puzzle: Plan
    quantize: QuantizeStep | None = Field(None, description="None: the BF16 child is served as it is.")
    evaluate: EvaluateStep
    pool: PoolServing | None = Field(None, description="Set in a package Job's plan only.")

    @property
    def stages(self) -> tuple[Stage, ...]:
        return tuple(s for s in BUILD_STAGES if s != "quantize" or self.quantize is not None)

    @property
    def checkpoint(self) -> str:
        """What is evaluated and served: the quantized checkpoint, or the BF16 child (also where the pool's
        engine cannot run the quantized one)."""
        quantized = self.quantize is not None and (self.pool is None or self.pool.quantized)
        return self.layout.quantized if quantized else self.layout.child

    def catalog(self) -> GpuCatalog:
        return GpuCatalog(list(self.gpu_profiles))

    def dump(self) -> str:
        return yaml.dump(self.model_dump(mode="json", by_alias=True, exclude_none=True), Dumper=DUMPER,
                         sort_keys=False)

    @classmethod
    def parse(cls, text: str) -> BuildPlan:
        """A plan from its YAML text (yaml.YAMLError or ValidationError when it is not one)."""
        return cls.model_validate(yaml.load(text, Loader=LOADER))

    @classmethod
    def load(cls, path: Path) -> BuildPlan:
        try:
            data = yaml.load(path.read_text(), Loader=LOADER)
        except (OSError, yaml.YAMLError) as error:
            raise PlanError(f"{path}: cannot read the build plan ({error})") from error
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise PlanError(f"{path}: not a build plan: {problems(error)}") from error
