"""The Triton Python-backend model `tailor package` writes: text or token ids in, text and ids out.

Runs inside tritonserver's Python-backend stub (which provides `triton_python_backend_utils`). The
repository's model.py re-exports `TritonPythonModel` from here. The checkpoint sits in the model
version folder (`<model>/1/checkpoint`). Inputs are checked before any generation: a request that
cannot be served gets an INVALID_ARG error (HTTP 400) naming the input, and the others in its batch
are still served. With the decoupled transaction policy every token is streamed as its own response.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from pydantic import ValidationError

from tailor.compressor.serving.generation import GenerationRequest, Generator

OPTIONAL = {"max_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int, "ignore_eos": bool}


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        torch.set_num_threads(int(parameters.get("torch_threads", "2")))
        folder = Path(args["model_repository"]) / args["model_version"] / "checkpoint"
        self.engine = Generator(folder, int(parameters["context_length"]), getattr(torch, parameters["dtype"]))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.name = args["model_name"]

    def _parse(self, request: Any) -> GenerationRequest:
        text = pb_utils.get_input_tensor_by_name(request, "text_input")
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if (text is None) == (ids is None):
            raise ValueError("send exactly one of text_input (a prompt) and input_ids (token ids)")
        if text is not None:
            values = text.as_numpy().reshape(-1)
            if values.size != 1:
                raise ValueError(f"text_input must hold one prompt per request, got {values.size}")
            prompt = values[0].decode("utf-8") if isinstance(values[0], bytes) else str(values[0])
            if not prompt.strip():
                raise ValueError("text_input is empty: send a non-empty prompt")
            tokens = self.engine.encode(prompt)
        else:
            tokens = [int(t) for t in ids.as_numpy().reshape(-1)]
            if not tokens:
                raise ValueError("input_ids is empty: send at least one token id")
        fields: dict[str, Any] = {"ids": tokens}
        for name, kind in OPTIONAL.items():
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                fields[name] = kind(tensor.as_numpy().reshape(-1)[0])
        try:
            parsed = GenerationRequest(**fields)
        except ValidationError as error:
            problem = error.errors()[0]
            raise ValueError(f"{problem['loc'][0]}: {problem['msg']}") from error
        self.engine.check(parsed)
        return parsed

    def _response(self, tokens: list[int], text: str | None = None) -> Any:
        """The response for `tokens`; `text` defaults to their decoding."""
        text = self.engine.decode(tokens) if text is None else text
        encoded = np.array([[text.encode("utf-8")]], dtype=np.object_)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", encoded),
            pb_utils.Tensor("output_ids", np.array([tokens], dtype=np.int64))])

    def execute(self, requests: list[Any]) -> list[Any] | None:
        responses: list[Any] = [None] * len(requests)
        valid: list[GenerationRequest] = []
        positions: list[int] = []
        for position, request in enumerate(requests):
            try:
                valid.append(self._parse(request))
                positions.append(position)
            except ValueError as error:
                responses[position] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"{self.name}: {error}", pb_utils.TritonError.INVALID_ARG))
        generated: list[list[int]] = [[] for _ in valid]
        senders = [request.get_response_sender() for request in requests] if self.decoupled else []

        def emit(index: int, token: int, last: bool) -> None:
            generated[index].append(token)
            if self.decoupled:  # the text this token adds (a token may complete a multi-byte character)
                delta = self.engine.decode(generated[index])[len(self.engine.decode(generated[index][:-1])):]
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0
                senders[positions[index]].send(self._response([token], delta), flags=flags)

        self.engine.generate(valid, emit)
        if self.decoupled:
            for position, response in enumerate(responses):
                if response is not None:
                    senders[position].send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
        for index, position in enumerate(positions):
            responses[position] = self._response(generated[index])
        return responses
