"""Models too large for one process: a checkpoint read block by block, and a checkpoint written block by block.

`LazyDecoder` opens a checkpoint folder without loading it: the model's skeleton is built on the meta device
(its slots, its layers' shapes), and `layer(i)` builds one layer with its weights read from the safetensors
files (memory-mapped, only that layer's tensors) in the compute dtype. A caller holds one layer at a time, so a
pass over the whole model needs the memory of its largest layer, its embedding or head, and the activations. The
embedding and the LM head, the largest tensors of a small model, stay in the dtype they are stored in (BF16 for
every checkpoint this project writes) and give their results in the compute dtype, widened a slice at a time:
the same values as a float32 copy, at half its memory.
`sweep` is that pass. A quantized export (`tailor quantize`) reads the same way, its quantized layers as the
project's NVFP4 / FP8 layers. `ShardedWriter` writes a model the same way: one safetensors file per layer and
`model.safetensors.index.json`, the Hugging Face layout for sharded checkpoints.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

from tailor.compressor.files import staged_folder
from tailor.compressor.model.architecture import ConfigError, architecture_from_config
from tailor.compressor.model.checkpoint import (
    LLAMA_TYPES,
    NEMOTRON_H_TYPES,
    QUANT_CONFIG,
    SCALE_SUFFIXES,
    SUPPORTED,
    CheckpointError,
    read_config,
    read_quant_config,
    settings_from_config,
    write_metadata,
)
from tailor.compressor.model.chunks import HEAD_SLICE, LAYER_TOKENS
from tailor.compressor.model.modeling import Decoder, HybridLayer, Layer, Rotary, Slot
from tailor.compressor.model.moe import PROJECTIONS, Experts, expert_names
from tailor.compressor.model.quantized import QuantizedCheckpointError, refresh_quantized, swap_quantized_layers
from tailor.compressor.peaks import release_freed_memory

INDEX_FILE = "model.safetensors.index.json"


class KeptAsStored(nn.Module):
    """A frozen vocabulary-sized weight kept in its checkpoint's dtype; results in the compute `dtype`."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.dtype = dtype


class StoredEmbedding(KeptAsStored):
    """An embedding table; looked-up rows are widened to `dtype` (exact for a narrower float)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(self.dtype)


class StoredHead(KeptAsStored):
    """An LM head; logits computed in `dtype`, HEAD_SLICE vocabulary rows widened at a time, so no widened copy
    of the whole head is ever held."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.weight.dtype == self.dtype:
            return F.linear(x, self.weight)
        logits = x.new_empty(*x.shape[:-1], self.weight.shape[0])
        for start in range(0, self.weight.shape[0], HEAD_SLICE):
            rows = self.weight[start:start + HEAD_SLICE]
            logits[..., start:start + rows.shape[0]] = F.linear(x, rows.to(self.dtype))
        return logits


def weight_map(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, or each file's header)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            names = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index}: unreadable index ({error})") from error
        return {name: folder / file for name, file in names.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights in the model folder")
    found: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                found.update(dict.fromkeys(handle.keys(), file))
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{file}: unreadable safetensors file ({error})") from error
    return found


def materialise(module: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """`module` (built on the meta device) holding `tensors`; its rotary frequencies recomputed."""
    module.load_state_dict(tensors, strict=True, assign=True)
    recompute_rotary(module, next(iter(tensors.values())).device if tensors else None)
    return module


def recompute_rotary(module: nn.Module, device: torch.device | None) -> None:
    """Rotary frequencies are not in checkpoints: a module built on the meta device computes them again."""
    for sub in module.modules():
        if isinstance(sub, Rotary):
            sub.inv_freq = sub.frequencies(device)


class LazyDecoder:
    """A checkpoint folder as a `Decoder` whose layers are read one at a time. A quantized export is read only
    when `quantized_ok` (evaluation); compression needs an unquantized model."""

    def __init__(self, folder: Path, dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                 quantized_ok: bool = False) -> None:
        self.folder, self.dtype, self.device = folder, dtype, device or torch.device("cpu")
        self.config = read_config(folder)
        source = str(folder / "config.json")
        if self.config.get("model_type") not in LLAMA_TYPES + NEMOTRON_H_TYPES:
            raise CheckpointError(f"{source}: field 'model_type' is {self.config.get('model_type')!r}; supported: "
                                  f"{SUPPORTED}")
        self.quantized = "quantization_config" in self.config
        if self.quantized and not quantized_ok:
            raise CheckpointError(f"{source}: has a quantization_config; compression and its stages need an "
                                  "unquantized (BF16 or FP32) model")
        # a modelopt export's `quantization` section: which layers are quantized, and how
        self.quantization = read_quant_config(folder)["quantization"] if self.quantized else {}
        try:
            self.arch = architecture_from_config(self.config, source)
        except ConfigError as error:
            raise CheckpointError(str(error)) from error
        self.settings = settings_from_config(self.config, source)
        with torch.device("meta"):
            self.skeleton = Decoder(self.arch, self.settings)
        self.files = weight_map(folder)
        self.shapes = {name: tuple(t.shape) for name, t in self.skeleton.state_dict().items()}
        expected = {name for name in self.shapes if not (self.arch.tie_word_embeddings and name == "lm_head.weight")}
        missing = sorted(expected - set(self.files))
        unexpected = sorted(name for name in set(self.files) - set(self.shapes)
                            if not (self.quantized and name.endswith(SCALE_SUFFIXES)))
        problems = [f"{label}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                    for label, names in (("missing", missing), ("unexpected", unexpected)) if names]
        if problems:
            raise CheckpointError(f"{folder}: weights do not match config.json ({'; '.join(problems)})")

    @property
    def family_prefix(self) -> str:
        return self.skeleton.body

    def _name_of(self, module: nn.Module) -> str:
        name: str = next(name for name, candidate in self.skeleton.named_modules() if candidate is module)
        return name

    def slots(self) -> list[Slot]:
        return self.skeleton.slots()

    def tensors(self, names: list[str], strip: str = "", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The named tensors, read from their files in the compute dtype (or `dtype`: BF16 to copy them into a
        checkpoint); `strip` removed from the names."""
        return {name.removeprefix(strip): tensor for name, tensor in self._read(names, dtype)}

    def stacked(self, prefix: str, projection: str, experts: int) -> torch.Tensor:
        """One projection of the routed experts under `prefix` as `moe.Experts` holds it, [experts, out, in],
        read an expert at a time into place: a layer's experts are never held twice."""
        names = expert_names(prefix, projection, experts)
        position = {name: index for index, name in enumerate(names)}
        out: torch.Tensor | None = None
        for name, tensor in self._read(names):
            if out is None:
                out = torch.empty((experts, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
            out[position[name]] = tensor
        assert out is not None
        return out

    def _read(self, names: list[str], dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) a tensor at a time, file by file."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        for file, wanted in by_file.items():
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in wanted:
                        tensor = handle.get_tensor(name)
                        if self._as_stored(name, tensor):  # quantized weights and their scales
                            yield name, tensor.to(self.device)
                            continue
                        if tuple(tensor.shape) != self.shapes[name]:
                            raise CheckpointError(f"{file}: tensor {name} has shape {tuple(tensor.shape)}, "
                                                  f"config.json gives {self.shapes[name]}")
                        if name.endswith("e_score_correction_bias"):
                            # kept as stored, and copied: a view would keep the file mapped, and with it every
                            # page this layer's conversions read
                            yield name, tensor.to(self.device, copy=True)
                            continue
                        yield name, tensor.to(self.device, dtype or self.dtype)
            except (SafetensorError, OSError) as error:
                raise CheckpointError(f"{file}: unreadable safetensors file ({error})") from error

    def _layer_state(self, module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors of layer `module` (named from `prefix` in the files) as it loads them: stacked experts
        read into their stacked form (`stacked`), the rest by name."""
        experts = {f"{name}.": len(sub) for name, sub in module.named_modules() if isinstance(sub, Experts)}
        plain = [name for name in module.state_dict() if not name.startswith(tuple(experts))]
        state = self.tensors([prefix + name for name in plain], strip=prefix)
        for inner, count in experts.items():
            for projection in PROJECTIONS:
                state[inner + projection] = self.stacked(prefix + inner, projection, count)
        return state

    def _as_stored(self, name: str, tensor: torch.Tensor) -> bool:
        return self.quantized and (name.endswith(SCALE_SUFFIXES) or tensor.dtype in (torch.uint8, torch.float8_e4m3fn))

    def end_names(self) -> list[str]:
        """The tensors outside the layers as stored: embedding, final norm and (unless tied) the LM head."""
        return [name for name in self.shapes if not name.startswith(f"{self.family_prefix}.layers.")
                and not (self.arch.tie_word_embeddings and name == "lm_head.weight")]

    def layer_prefix(self, index: int) -> str:
        return f"{self.family_prefix}.layers.{index}."

    def layer(self, index: int) -> Layer | HybridLayer:
        """Layer `index` with its weights: the caller drops it when done. The heap's freed memory goes back to
        the system first (`peaks.release_freed_memory`): glibc serves a layer's tensors from freed heap blocks
        (its mmap threshold rises as large blocks are freed, and a stage after a training stage finds its heap
        full of them) and keeps them resident once freed, so without it a pass holds every layer size it saw:
        the memory benchmark's evaluation after GKD peaked 0.38 GiB higher than in a fresh process."""
        release_freed_memory()
        prefix = self.layer_prefix(index)
        module = self.skeleton.layers[index]
        fresh = _rebuild(module)
        if not self.quantized:
            materialise(fresh, self._layer_state(module, prefix))
        else:
            tensors = self.tensors([name for name in self.files if name.startswith(prefix)], strip=prefix)
            try:  # the quantized layers are built weightless: their tensors are assigned from `tensors`
                with torch.device("meta"):
                    swap_quantized_layers(fresh, tensors, self.quantization, self.folder / QUANT_CONFIG, self.dtype,
                                          prefix)
            except QuantizedCheckpointError as error:
                raise CheckpointError(str(error)) from error
            materialise(fresh, tensors)
            refresh_quantized(fresh)
        assert isinstance(fresh, Layer | HybridLayer)
        return fresh

    @property
    def embedding_name(self) -> str:
        return f"{self._name_of(self.skeleton.embedding)}.weight"

    def stored(self, name: str) -> torch.Tensor:
        """A floating-point tensor as its file stores it, or in the compute dtype where that is narrower."""
        try:
            with safe_open(str(self.files[name]), framework="pt") as handle:
                kind = handle.get_slice(name).get_dtype()
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{self.files[name]}: unreadable safetensors file ({error})") from error
        dtype = {"BF16": torch.bfloat16, "F16": torch.float16}.get(kind, self.dtype)
        if dtype.itemsize > self.dtype.itemsize:
            dtype = self.dtype
        return self.tensors([name], dtype=dtype)[name]

    def embedding(self) -> StoredEmbedding:
        """Token ids -> the residual stream in the compute dtype; the table kept as stored."""
        return StoredEmbedding(self.stored(self.embedding_name), self.dtype).eval()

    def head(self) -> nn.Sequential:
        """The final norm and the LM head: hidden states -> logits in the compute dtype; the head kept as stored."""
        norm = _rebuild(self.skeleton.final_norm)
        norm_name = f"{self._name_of(self.skeleton.final_norm)}."
        materialise(norm, self.tensors([f"{norm_name}weight"], strip=norm_name))
        if "lm_head.weight_scale" in self.files:
            raise CheckpointError(f"{self.folder}: a quantized LM head is not read layer by layer (no recipe "
                                  "quantizes it)")
        name = self.embedding_name if self.arch.tie_word_embeddings else "lm_head.weight"
        return nn.Sequential(norm, StoredHead(self.stored(name), self.dtype)).eval()

    def load(self) -> Decoder:
        """The whole model, for what needs it resident (timing a decode step); only for models that fit."""
        if self.quantized:
            raise CheckpointError(f"{self.folder}: a quantized export is read whole by checkpoint.load_decoder")
        decoder = _rebuild(self.skeleton)
        assert isinstance(decoder, Decoder)
        tensors = self.tensors([name for name in self.shapes if name != "lm_head.weight" or
                                not self.arch.tie_word_embeddings])
        if self.arch.tie_word_embeddings:
            tensors["lm_head.weight"] = tensors[self.embedding_name]
        materialise(decoder, tensors)
        if self.arch.tie_word_embeddings:
            decoder.lm_head.weight = decoder.embedding.weight
        return decoder.eval()


def _rebuild(module: nn.Module) -> nn.Module:
    """A meta-device copy of a skeleton module (so the skeleton itself stays weightless)."""
    return copy.deepcopy(module)


@torch.no_grad()
def run_rows(layer: Layer | HybridLayer, slot: Slot, x: torch.Tensor) -> torch.Tensor:
    """The stream `x` after `slot` of `layer`, LAYER_TOKENS tokens (whole sequences, at least one) per call."""
    rows = max(1, LAYER_TOKENS // x.shape[1])
    return torch.cat([layer.run_branch(slot.kind, x[i:i + rows]) for i in range(0, x.shape[0], rows)])


def sweep(model: LazyDecoder, x: torch.Tensor, visit: Callable[[Slot, torch.Tensor], None] | None = None,
          ) -> torch.Tensor:
    """The residual stream `x` (entering the first slot) through the model, one layer resident at a time,
    LAYER_TOKENS tokens (whole sequences, at least one) per call; `visit(slot, x)` sees the stream entering every
    slot."""
    slots = model.slots()
    for layer_index in sorted({slot.layer for slot in slots}):
        layer = model.layer(layer_index)
        with torch.no_grad():
            for slot in (s for s in slots if s.layer == layer_index):
                if visit is not None:
                    visit(slot, x)
                x = run_rows(layer, slot, x)
        del layer
    return x


class ShardedWriter:
    """Writes a checkpoint folder one group of tensors at a time (one file per layer), staged then renamed."""

    def __init__(self, staging: Path, shards: int) -> None:
        self.staging, self.shards, self.count = staging, shards, 0
        self.index: dict[str, str] = {}
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor], as_stored: bool = False) -> None:
        """One shard: the tensors in BF16, or `as_stored` (a quantized export's mixed dtypes) as they are."""
        self.count += 1
        name = f"model-{self.count:05d}-of-{self.shards:05d}.safetensors"
        state = {k: (v if as_stored else v.to(torch.bfloat16)).detach().cpu().contiguous() for k, v in tensors.items()}
        save_file(state, self.staging / name, metadata={"format": "pt"})
        self.index.update(dict.fromkeys(state, name))
        self.total += sum(t.numel() * t.element_size() for t in state.values())

    def finish(self) -> None:
        if self.count != self.shards:
            raise RuntimeError(f"wrote {self.count} of {self.shards} shards")
        (self.staging / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": self.total},
                                                           "weight_map": self.index}, indent=2) + "\n")


@contextmanager
def sharded_checkpoint(folder: Path, config: dict[str, Any], tokenizer_from: Path,
                       shards: int) -> Iterator[ShardedWriter]:
    """A checkpoint folder written shard by shard: config, tokenizer files, then the writer's shards."""
    with staged_folder(folder) as staging:
        writer = ShardedWriter(staging, shards)
        yield writer
        writer.finish()
        write_metadata(staging, config, tokenizer_from)
