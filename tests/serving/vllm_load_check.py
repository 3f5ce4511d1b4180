"""Run in vLLM's environment (`.venv-vllm/bin/python vllm_load_check.py folder...`): would vLLM load each
checkpoint on a GPU? vLLM's own code does each step its engine does, short of allocating and computing: its
ModelConfig reads the config (remote code included) and the quantization config, its registry resolves the
architecture, the model class is built on the meta device under the current VllmConfig, and every tensor of the
checkpoint (its name, shape and dtype from the safetensors headers, as a meta tensor) goes through the model's
`load_weights`. Prints one JSON object per folder: the class, the quantization method, and what failed: tensors
the loader refused (its error) or no parameter took, parameters no tensor filled (or filled by other sizes),
dtypes that differ.

Three construction steps choose a CUDA kernel and refuse on a CPU; for a meta-device build they are told what an
H100 would choose (`_as_on_a_gpu`): the NVFP4 linear kernel (emulation, whose weights are the CUTLASS kernel's),
the non-gated MoE's platform check and backend (Triton), the NVFP4 MoE backend (Marlin). Nothing is computed, so
no kernel runs. `process_weights_after_loading` (repacking for a kernel) is not run.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn",
                      "U8": "uint8", "I8": "int8", "I32": "int32", "I64": "int64", "BOOL": "bool"}
H100_CAPABILITY = 90
# an attention layer's scales for an FP8 KV cache and FP8 attention, which vLLM sets to 1.0 where a checkpoint has
# none (a BF16 KV cache)
ENGINE_SET = (".attn.k_scale", ".attn.v_scale", ".attn.q_scale", ".attn.prob_scale")


def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header: its length in bytes (after the 8 that give it) and its JSON."""
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        return length, json.loads(file.read(length))


def checkpoint_tensors(folder: Path) -> dict[str, tuple[list[int], str]]:
    """Every tensor's shape and dtype, from the headers of the folder's safetensors files (no data read)."""
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        _, header = safetensors_header(path)
        for name, entry in header.items():
            if name != "__metadata__":
                found[name] = (entry["shape"], SAFETENSORS_DTYPES[entry["dtype"]])
    return found


class _CudaAlike:
    """The CPU platform, but for the one question the MoE config asks before building a non-gated MoE."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    def is_cuda_alike(self) -> bool:
        return True


def _as_on_a_gpu() -> None:
    """The kernel choices an H100 makes, where vLLM's CPU platform refuses at construction."""
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.model_executor.layers.fused_moe import config as moe_config
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as unquantized
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as unquantized_oracle
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    moe_config.current_platform = _CudaAlike(moe_config.current_platform)  # type: ignore[assignment]
    for module in (unquantized, unquantized_oracle):
        module.select_unquantized_moe_backend = (  # type: ignore[attr-defined]
            lambda *args, **kwargs: (UnquantizedMoeBackend.TRITON, None))
    modelopt.select_nvfp4_moe_backend = (  # type: ignore[assignment]
        lambda *args, **kwargs: (NvFp4MoeBackend.MARLIN, None))


def check(folder: Path) -> dict[str, Any]:
    import torch
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.utils import get_model_architecture, initialize_model
    from vllm.model_executor.parameter import PerTensorScaleParameter
    from vllm.utils.torch_utils import set_default_torch_dtype

    report: dict[str, Any] = {"folder": str(folder)}
    model_config = ModelConfig(model=str(folder), tokenizer=str(folder), trust_remote_code=True, dtype="bfloat16",
                               enforce_eager=True, skip_tokenizer_init=True, max_model_len=256)
    vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(vllm_config):
        _distributed()
        quant = vllm_config.quant_config
        report["quantization"] = quant.get_name() if quant is not None else None
        if quant is not None:
            report["min_capability"] = quant.get_min_capability()
            if quant.get_min_capability() > H100_CAPABILITY:
                report.setdefault("errors", []).append(f"{quant.get_name()} needs compute capability "
                                                       f"{quant.get_min_capability()}, an H100 has 90")
        model_class, report["architecture"] = get_model_architecture(model_config)
        report["class"] = model_class.__name__
        with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
            model = initialize_model(vllm_config=vllm_config)
    params = dict(model.named_parameters())
    filled: dict[str, int] = defaultdict(int)
    unmapped, refused, dtypes = [], [], []
    for name, (shape, dtype) in checkpoint_tensors(folder).items():
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        try:
            loaded = model.load_weights([(name, tensor)])
        except (ValueError, RuntimeError, KeyError, AssertionError) as refusal:  # what vLLM's loader raises
            refused.append(f"{name} {shape}: {type(refusal).__name__}: {str(refusal).splitlines()[0][:300]}")
            continue
        if not loaded:
            unmapped.append(name)
        for param in loaded:
            filled[param] += tensor.numel()
            if params[param].dtype != tensor.dtype and (tensor.dtype.itemsize == 1 or params[param].dtype.itemsize
                                                        == 1):
                dtypes.append(f"{name} is {tensor.dtype}, {param} is {params[param].dtype}")
    unfilled = sorted(name for name in params.keys() - filled.keys() if not name.endswith(ENGINE_SET))
    sizes = []
    for name, param in params.items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        expected = param.numel()
        if isinstance(module, VocabParallelEmbedding):
            expected = module.org_vocab_size * module.embedding_dim
        whole = isinstance(param, PerTensorScaleParameter) and filled[name] == 1  # one scale for every shard
        if name in filled and filled[name] != expected and not whole:
            sizes.append(f"{name}: {filled[name]} values loaded, {expected} expected")
    report |= {"parameters": len(params), "refused": refused, "unmapped": unmapped, "unfilled": unfilled,
               "sizes": sizes, "dtypes": dtypes}
    return report


def _distributed() -> None:
    """One process group of one rank (gloo), and the model-parallel groups the current config asks for (the
    expert-parallel group exists only for a MoE model's config): made again for each model."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{os.environ['TAILOR_CHECK_PORT']}")
    else:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)


def main() -> None:
    _as_on_a_gpu()
    for folder in sys.argv[1:]:
        try:
            report = check(Path(folder))
        except Exception:  # the failure is the finding: report it and go on to the next folder
            report = {"folder": folder, "errors": [traceback.format_exc(limit=-6)]}
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
