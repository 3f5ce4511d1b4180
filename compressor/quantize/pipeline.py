"""`tailor quantize`: calibrate with modelopt and export a layer at a time (`streamed`), reload the export with
the project's loader and measure what quantization cost, all before the output folder appears.

    out/model-0000N-of-0000M.safetensors + model.safetensors.index.json   one shard per layer, then the ends
    out/config.json (with quantization_config), hf_quant_config.json, tokenizer files
    out/quantization.json   the report (written into the staged folder, which is renamed when complete)

Calibration uses the corpus's training text and evaluation its held-out text (the same rule as
`tailor compress`). Quality is measured on the reloaded export, so it is the quality of what is shipped:
perplexity, KL to the unquantized model and, given its folder, KL to the parent; every model is read a
layer at a time, so the job needs one layer, the calibration stream and the LM head's logits, not the model.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerFast

from tailor.compressor.files import staged_folder, write_json
from tailor.compressor.model.lazy import LazyDecoder
from tailor.compressor.puzzle.data import corpus_texts
from tailor.compressor.puzzle.evaluate import Quality, qualities
from tailor.compressor.puzzle.pipeline import Log, resolve_device
from tailor.compressor.puzzle.plan import Corpus
from tailor.compressor.quantize.recipes import QuantFormat, choose_recipe
from tailor.compressor.quantize.streamed import write_quantized
from tailor.compressor.results import QuantizeResult
from tailor.compressor.sizing.hardware import GpuProfile
from tailor.compressor.sizing.memory import RECIPES, KvDtype, weight_bytes
from tailor.compressor.text import token_windows

REPORT_FILE = "quantization.json"
BF16 = RECIPES["bf16"]


class QuantizeJob(BaseModel):
    """What one `tailor quantize` run does."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path = Field(description="The model folder to quantize (a parent or a Puzzle child).")
    out: Path = Field(description="The quantized checkpoint folder to write.")
    format: QuantFormat = QuantFormat.AUTO
    kv_cache: KvDtype = Field(KvDtype.BF16, description="fp8: calibrate FP8 KV-cache scales too.")
    parent: Path | None = Field(None, description="The parent folder, to report KL to it as well.")
    corpus: Corpus = Field(Corpus(), description="Calibration (training) and evaluation (held-out) text, as "
                                                 "`tailor compress` reads it.")
    seq_len: int = Field(256, ge=16)
    calibration_tokens: int = Field(4096, ge=16, description="Tokens of the training text run through the "
                                                               "model to calibrate input scales.")
    eval_tokens: int = Field(4096, ge=16, description="Held-out tokens the quality figures are measured on.")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="auto: the GPU where there is one, else the CPU; the model is read and "
                                    "quantized a layer at a time on it.")


class Figures(BaseModel):
    quality: Quality
    kl_to_parent: float | None


class QuantReport(BaseModel):
    model: str
    out: str
    format: str
    recipe: str
    modelopt_config: str
    reason: str
    quant_algo: str
    kv_cache_quant_algo: str | None
    quantized_layers: int
    excluded_layers: list[str]
    repairs: list[str]
    bytes_before: int  # safetensors files of the source folder
    bytes_after: int
    bf16_weight_bytes: int  # the memory model's count in BF16
    predicted_weight_bytes: int  # the memory model's count for the recipe (what sizing uses)
    unquantized: Figures
    quantized: Figures
    calibration_tokens: int
    eval_tokens: int
    stage_seconds: dict[str, float]
    peak_memory_bytes: dict[str, dict[str, int]]  # per stage: peak RSS and GPU allocation, and at its start

    def markdown(self) -> str:
        before, after = self.unquantized, self.quantized
        rows = [f"# Quantization report: {self.recipe}", "", self.reason, "",
                "| | unquantized | quantized |", "| --- | --- | --- |",
                f"| weight bytes (files) | {self.bytes_before:,} | {self.bytes_after:,} |",
                f"| weight bytes vs BF16 | {self.bf16_weight_bytes:,} | "
                f"{self.bytes_after / self.bf16_weight_bytes:.3f}x |",
                f"| held-out perplexity | {before.quality.perplexity:.3f} | {after.quality.perplexity:.3f} |",
                f"| KL to the unquantized model | 0 | {after.quality.kl:.4f} |"]
        if after.kl_to_parent is not None and before.kl_to_parent is not None:
            rows.append(f"| KL to the parent | {before.kl_to_parent:.4f} | {after.kl_to_parent:.4f} |")
        rows += ["", f"{self.quantized_layers} layers in {self.quant_algo}, KV cache in "
                 f"{self.kv_cache_quant_algo or 'BF16'}; left in BF16: "
                 f"{', '.join(self.excluded_layers) or 'none'}. Memory model: {self.predicted_weight_bytes:,} "
                 "weight bytes."]
        rows += [f"Repaired: {repair}" for repair in self.repairs]
        return "\n".join(rows) + "\n"

    def result(self) -> QuantizeResult:
        """The short form the operator reads from the Job."""
        return QuantizeResult(checkpoint=self.out, recipe=self.recipe, quant_algo=self.quant_algo,
                              kv_cache_quant_algo=self.kv_cache_quant_algo, weight_bytes=self.bytes_after,
                              kl_to_unquantized=self.quantized.quality.kl)


def _file_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def run(job: QuantizeJob, gpu: GpuProfile | None) -> QuantReport:
    log = Log()
    device = resolve_device(job.device)
    model = LazyDecoder(job.model, device=device)
    recipe, reason = choose_recipe(job.format, model.arch, gpu)
    log(reason)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(job.model)  # a DeciLM child's config needs remote code
    train_texts, heldout_texts = corpus_texts(job.corpus)
    calibration = token_windows(train_texts, tokenizer, job.seq_len, job.calibration_tokens).to(device)
    held_out = token_windows(heldout_texts, tokenizer, job.seq_len, job.eval_tokens).to(device)
    for source, ids in ((f"data.text: {job.corpus.text}", calibration), (job.corpus.heldout_source(), held_out)):
        if ids.numel() == 0:
            raise ValueError(f"{source} gives no {job.seq_len}-token window")
    with staged_folder(job.out) as staging:
        with log.stage("calibrate and export, layer by layer"):
            done = write_quantized(model, recipe, calibration, job.kv_cache, staging, log)
            for repair in done.repairs:
                log(f"repaired hf_quant_config.json: {repair}")
        with log.stage("evaluate"):
            models = {"unquantized": model, "quantized": LazyDecoder(staging, device=device, quantized_ok=True)}
            if job.parent is not None:
                models["parent"] = LazyDecoder(job.parent, device=device)
            found = qualities(models, [(label, reference) for label in ("unquantized", "quantized")
                                       for reference in ("unquantized", "parent") if reference in models], held_out)
            figures = {}
            for label in ("unquantized", "quantized"):
                figures[label] = Figures(quality=found[(label, "unquantized")],
                                         kl_to_parent=found[(label, "parent")].kl if "parent" in models else None)
                log(f"{label}: perplexity {figures[label].quality.perplexity:.3f}, KL to the unquantized "
                    f"{figures[label].quality.kl:.4f}")
        section = done.quant_config["quantization"]
        report = QuantReport(
            model=str(job.model), out=str(job.out), format=job.format.value, recipe=recipe.name,
            modelopt_config=str(recipe.modelopt_config), reason=reason, quant_algo=section["quant_algo"],
            kv_cache_quant_algo=section.get("kv_cache_quant_algo"),
            quantized_layers=len(done.quantized_layers), excluded_layers=section["exclude_modules"],
            repairs=done.repairs, bytes_before=_file_bytes(job.model), bytes_after=_file_bytes(staging),
            predicted_weight_bytes=weight_bytes(model.arch, recipe), bf16_weight_bytes=weight_bytes(model.arch, BF16),
            calibration_tokens=calibration.numel(), peak_memory_bytes=log.peaks,
            eval_tokens=held_out.numel(), stage_seconds=log.seconds, **figures)
        write_json(staging / REPORT_FILE, json.loads(report.model_dump_json()))
    return report
