"""Calling a `tailor package` model through tritonclient.

- `generate`: a vLLM-engine model (NVIDIA's vLLM backend on GPUs, tailor's on this machine), whose
  interface is a prompt, `sampling_parameters` as JSON and a `stream` flag; decoupled, so over a gRPC stream.
- `infer` and `stream`: the Python fallback engine's interface (a prompt or token ids, one tensor per
  sampling parameter), over HTTP or gRPC.

Light: numpy and tritonclient only, so the operator and benchmarks can use it without torch.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

PARAMETERS = {"max_tokens": ("INT32", np.int32), "temperature": ("FP32", np.float32), "top_k": ("INT32", np.int32),
              "top_p": ("FP32", np.float32), "seed": ("INT64", np.int64), "ignore_eos": ("BOOL", np.bool_)}


@dataclass
class Completion:
    text: str
    ids: list[int] = field(default_factory=list)


def inputs(module: Any, prompt: str | None = None, ids: list[int] | None = None,
           **parameters: float | int | bool | None) -> list[Any]:
    """The request tensors (batch of one) for `httpclient` or `grpcclient`."""
    if (prompt is None) == (ids is None):
        raise ValueError("give exactly one of a prompt and token ids")
    tensors = []
    if prompt is not None:
        tensor = module.InferInput("text_input", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[prompt.encode("utf-8")]], dtype=np.object_))
    else:
        tensor = module.InferInput("input_ids", [1, len(ids or [])], "INT64")
        tensor.set_data_from_numpy(np.array([ids], dtype=np.int64))
    tensors.append(tensor)
    for name, value in parameters.items():
        if value is None:
            continue
        datatype, dtype = PARAMETERS[name]
        tensor = module.InferInput(name, [1, 1], datatype)
        tensor.set_data_from_numpy(np.array([[value]], dtype=dtype))
        tensors.append(tensor)
    return tensors


def _completion(result: Any) -> Completion:
    text = result.as_numpy("text_output").reshape(-1)[0]
    return Completion(text.decode("utf-8") if isinstance(text, bytes) else str(text),
                      [int(t) for t in result.as_numpy("output_ids").reshape(-1)])


def infer(url: str, model: str, protocol: str = "http", prompt: str | None = None, ids: list[int] | None = None,
          timeout: float = 300.0, **parameters: float | int | bool | None) -> Completion:
    """One request to a non-decoupled model."""
    if protocol == "http":
        http = httpclient.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout)
        try:
            return _completion(http.infer(model, inputs(httpclient, prompt, ids, **parameters)))
        finally:
            http.close()
    client = grpcclient.InferenceServerClient(url)
    try:
        return _completion(client.infer(model, inputs(grpcclient, prompt, ids, **parameters),
                                        client_timeout=timeout))
    finally:
        client.close()


def stream(url: str, model: str, on_text: Callable[[str], None], prompt: str | None = None,
           ids: list[int] | None = None, timeout: float = 300.0, **parameters: float | int | bool | None
           ) -> Completion:
    """One request to a decoupled model over a gRPC stream; `on_text` gets each piece as it arrives."""
    pieces: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    text, tokens = [], []
    try:
        client.start_stream(callback=lambda result, error: pieces.put(error or result),
                            stream_timeout=timeout)
        client.async_stream_infer(model, inputs(grpcclient, prompt, ids, **parameters),
                                  enable_empty_final_response=True)
        while True:
            item = pieces.get(timeout=timeout)
            if isinstance(item, InferenceServerException):
                raise item
            response = item.get_response()
            if response.outputs:
                piece = _completion(item)
                text.append(piece.text)
                tokens += piece.ids
                on_text(piece.text)
            if response.parameters.get("triton_final_response") and \
                    response.parameters["triton_final_response"].bool_param:
                return Completion("".join(text), tokens)
    finally:
        client.stop_stream()
        client.close()


@dataclass
class Generation:
    text: str
    finish_reason: str | None = None
    output_tokens: int | None = None


def generate(url: str, model: str, prompt: str, sampling: dict[str, Any] | None = None, *, stream: bool = False,
             on_text: Callable[[str], None] | None = None, timeout: float = 300.0) -> Generation:
    """One request to a vLLM-engine model over a gRPC stream: the completion (without the prompt), its finish
    reason and output token count; with `stream`, `on_text` gets each piece as it arrives."""
    def tensor(name: str, value: Any) -> Any:
        datatype, dtype = ("BYTES", np.object_) if isinstance(value, bytes) else ("BOOL", np.bool_)
        made = grpcclient.InferInput(name, [1], datatype)
        made.set_data_from_numpy(np.array([value], dtype=dtype))
        return made

    tensors = [tensor("text_input", prompt.encode("utf-8")), tensor("stream", stream),
               tensor("sampling_parameters", json.dumps(sampling or {}).encode()),
               tensor("exclude_input_in_output", True), tensor("return_finish_reason", True),
               tensor("return_num_output_tokens", True)]
    pieces: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    text: list[str] = []
    reason, count = None, None
    try:
        client.start_stream(callback=lambda result, error: pieces.put(error or result), stream_timeout=timeout)
        client.async_stream_infer(model, tensors, enable_empty_final_response=True)
        while True:
            item = pieces.get(timeout=timeout)
            if isinstance(item, InferenceServerException):
                raise item
            response = item.get_response()
            names = {output.name for output in response.outputs}
            if "text_output" in names:
                piece = item.as_numpy("text_output").reshape(-1)[0].decode("utf-8")
                text.append(piece)
                if on_text is not None:
                    on_text(piece)
            if "finish_reason" in names:
                reason = item.as_numpy("finish_reason").reshape(-1)[0].decode() or None
            if "num_output_tokens" in names:
                count = int(item.as_numpy("num_output_tokens").reshape(-1)[0])
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return Generation("".join(text), reason, count)
    finally:
        client.stop_stream()
        client.close()
