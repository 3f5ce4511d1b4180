"""`tailor openai`: an OpenAI-compatible HTTP API in front of a Triton server's vLLM models.

It runs beside tritonserver, in the same pod (a second container) or on the same machine, and translates:
- `GET /v1/models`: the repository's vLLM models (those with engine arguments, `model.json`);
- `POST /v1/completions` and `POST /v1/chat/completions` (the chat template from the model's tokenizer), with
  `stream` as server-sent events, into Triton's `generate` / `generate_stream` requests to tailor's vLLM backend
  (`vllm_backend.py`: `text_input`, `sampling_parameters`, ...);
- `GET /health`: 200 once Triton is ready.
Errors have OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`): a request field this server does
not take, or a value the engine refuses, is a 400 naming it; an unknown model a 404. NVIDIA ships such a frontend
in its Triton images (`/opt/tritonserver/python/openai`), but it runs Triton in-process through Python bindings
that the Triton here (pytriton's 2.51) lacks; this one talks to any Triton over HTTP, the same code on every pool.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tailor.compressor.serving.chat_template import ChatRenderer, TemplateError
from tailor.compressor.sizing.engines import ENGINE_ARGS_FILE

# OpenAI's sampling fields and what tailor's vLLM backend calls them; vLLM's own extras pass as they are
SAMPLING = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
            "top_p": "top_p", "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "n": "n", "top_k": "top_k", "min_p": "min_p",
            "min_tokens": "min_tokens", "ignore_eos": "ignore_eos", "repetition_penalty": "repetition_penalty"}
# fields clients send that change nothing here (`user`), or change nothing at their default
IGNORED = {"user": None, "logprobs": (None, False), "echo": (False,), "best_of": (None, 1), "logit_bias": (None,),
           "stream_options": None, "suffix": (None,), "tools": (None,), "tool_choice": (None, "none"),
           "response_format": (None, {"type": "text"}), "parallel_tool_calls": None}
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default for /v1/completions; chat completions may use the whole context


class RequestError(Exception):
    """A request this server refuses, with OpenAI's error fields."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def response(self) -> web.Response:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return web.json_response({"error": {"message": str(self), "type": kind, "param": self.param,
                                             "code": self.code}}, status=self.status)


@dataclass
class Model:
    """A served model: its name, context length and tokenizer (loaded on first use)."""

    name: str
    checkpoint: Path
    context: int
    tokenizer: Any = None
    renderer: ChatRenderer | None = None

    def tokens(self, text: str) -> int:
        return len(self.load().encode(text, add_special_tokens=False))

    async def chat_prompt(self, messages: Any) -> str:
        """The prompt the model's chat template makes of OpenAI `messages`, rendered in its worker
        (`chat_template`: bounded in time and output)."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
        turns = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError(f"messages[{index}] must be an object with a role", f"messages[{index}]")
            turns.append({"role": message["role"], "content": _text(message.get("content"), index)})
        if self.renderer is None:
            self.renderer = ChatRenderer(self.checkpoint)
        try:
            return await self.renderer.render(turns)
        except TemplateError as error:
            if error.missing:
                raise RequestError(f"model {self.name} has no chat template: use /v1/completions", "messages") from None
            raise RequestError(f"model {self.name}: {error}", "messages") from error

    def load(self) -> Any:
        """The model's tokenizer (its files beside the weights; no code of its own is run)."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.checkpoint, trust_remote_code=False)
        return self.tokenizer


def _text(content: Any, index: int) -> str:
    """A message's text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise RequestError(f"messages[{index}].content must be a string or a list of text parts", f"messages[{index}]")


def read_models(repository: Path, mount: str | None = None) -> dict[str, Model]:
    """The vLLM models of a Triton repository, by name. model.json names the checkpoint where the pod mounts it;
    where the repository is elsewhere (`tailor serve` of a package, the devcluster) the folder beside it is used."""
    models = {}
    for args_file in sorted(repository.glob(f"*/*/{ENGINE_ARGS_FILE}")):
        args = json.loads(args_file.read_text())
        checkpoint = Path(args["model"])
        if not checkpoint.exists():
            checkpoint = args_file.parent / "checkpoint"
        name = args_file.parent.parent.name
        models[name] = Model(name=name, checkpoint=checkpoint, context=int(args["max_model_len"]))
    return models


def sampling(body: dict[str, Any], default_tokens: int) -> dict[str, Any]:
    """The backend's sampling_parameters from an OpenAI request body; a field it cannot honour is refused."""
    fields: dict[str, Any] = {"max_tokens": default_tokens}
    for key, value in body.items():
        if key in SAMPLING and value is not None:
            fields[SAMPLING[key]] = [value] if key == "stop" and isinstance(value, str) else value
        elif key in IGNORED:
            allowed = IGNORED[key]
            if allowed is not None and value not in allowed:
                raise RequestError(f"{key} is not supported by this server", key)
        elif key not in ("model", "prompt", "messages", "stream"):
            raise RequestError(f"Unrecognized request argument supplied: {key}", key)
    return fields


class Frontend:
    def __init__(self, triton: str, models: dict[str, Model]) -> None:
        self.triton, self.models = triton.rstrip("/"), models
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=16 * 2**20)
        app.add_routes([web.get("/v1/models", self.list_models), web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat), web.get("/health", self.health)])
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))

    async def _close(self, _: web.Application) -> None:
        if self.session is not None:
            await self.session.close()
        for model in self.models.values():
            if model.renderer is not None:
                await model.renderer.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except RequestError as error:
            return error.response()
        except web.HTTPException as error:
            return RequestError(error.reason, status=error.status).response()
        except aiohttp.ClientError as error:
            return RequestError(f"the inference server is not reachable: {error}", status=503).response()

    async def health(self, _: web.Request) -> web.Response:
        assert self.session is not None
        try:
            async with self.session.get(f"{self.triton}/v2/health/ready") as reply:
                ready = reply.status == 200
        except aiohttp.ClientError:
            ready = False
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def list_models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "tailor", "max_model_len": model.context}
            for name, model in self.models.items()]})

    async def _body(self, request: web.Request) -> tuple[dict[str, Any], Model]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise RequestError(f"the request body is not JSON: {error}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        name = body.get("model")
        if not isinstance(name, str):
            raise RequestError("model is required: one of the names /v1/models lists", "model")
        if name not in self.models:
            raise RequestError(f"The model `{name}` does not exist; this server has {', '.join(self.models)}",
                               "model", 404, "model_not_found")
        return body, self.models[name]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, model = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string (one prompt per request)", "prompt")
        return await self._generate(request, body, model, prompt, COMPLETION_DEFAULT_TOKENS, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body, model = await self._body(request)
        prompt = await model.chat_prompt(body.get("messages"))
        prompt_tokens = await asyncio.to_thread(model.tokens, prompt)
        return await self._generate(request, body, model, prompt, max(1, model.context - prompt_tokens), chat=True)

    async def _generate(self, request: web.Request, body: dict[str, Any], model: Model, prompt: str,
                        default_tokens: int, chat: bool) -> web.StreamResponse:
        fields = sampling(body, default_tokens)
        stream = bool(body.get("stream"))
        payload = {"text_input": prompt, "sampling_parameters": json.dumps(fields), "stream": stream,
                   "exclude_input_in_output": True, "return_finish_reason": True, "return_num_output_tokens": True}
        reply = Reply(model.name, chat, await asyncio.to_thread(model.tokens, prompt))  # off the event loop
        events = self._triton(model.name, payload, stream)
        try:  # a client that goes away closes Triton's stream, and the engine drops the request
            first = await anext(events)  # a refused request is refused before any event is streamed
            if not stream:
                return web.json_response(reply.whole(first))
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            for chunk in reply.opening():
                await response.write(sse(chunk))
            event: dict[str, Any] | None = first
            while event is not None:
                for chunk in reply.chunks(event, include_usage):
                    await response.write(sse(chunk))
                event = await anext(events, None)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            await events.aclose()

    async def _triton(self, name: str, payload: dict[str, Any], stream: bool) -> AsyncGenerator[dict[str, Any], None]:
        """Triton's responses to one request: one for `generate`, each event of `generate_stream`; an error is
        raised as the status Triton gave (400 for what the backend refuses)."""
        assert self.session is not None
        url = f"{self.triton}/v2/models/{name}/{'generate_stream' if stream else 'generate'}"
        async with self.session.post(url, json=payload) as reply:
            if reply.status != 200:
                raise _refused(await reply.text(), reply.status)
            if not stream:
                yield await reply.json()
                return
            async for line in reply.content:
                text = line.decode("utf-8").strip()
                if text.startswith("data:"):
                    event = json.loads(text[5:])
                    if "error" in event:
                        raise _refused(json.dumps(event), 400)
                    yield event


def _refused(text: str, status: int) -> RequestError:
    try:
        message = json.loads(text).get("error", text)
    except (json.JSONDecodeError, AttributeError):
        message = text
    param = "sampling_parameters" if "sampling_parameters" in message else None
    return RequestError(str(message), param, 400 if status < 500 else 502)


def sse(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


class Reply:
    """OpenAI's response objects for one request, completion or chat."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int) -> None:
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, choice: dict[str, Any], suffix: str = "") -> dict[str, Any]:
        return {"id": self.id, "object": self.object + suffix, "created": self.created, "model": self.model,
                "choices": [choice]}

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def whole(self, event: dict[str, Any]) -> dict[str, Any]:
        text, reason = event.get("text_output", ""), event.get("finish_reason") or "stop"
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        return {**self._envelope(choice), "usage": self._usage(int(event.get("num_output_tokens", 0)))}

    def opening(self) -> list[dict[str, Any]]:
        """A chat stream opens with the assistant's role."""
        if not self.chat:
            return []
        return [self._envelope({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                "logprobs": None}, ".chunk")]

    def chunks(self, event: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
        """The chunks one streamed event makes: its text, then the finish reason (and usage) at the end."""
        out, text, reason = [], event.get("text_output", ""), event.get("finish_reason")
        suffix = ".chunk" if self.chat else ""
        if text:
            piece: dict[str, Any] = {"delta": {"content": text}} if self.chat else {"text": text}
            out.append(self._envelope({"index": 0, **piece, "finish_reason": None, "logprobs": None}, suffix))
        if reason:
            end: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
            out.append(self._envelope({"index": 0, **end, "finish_reason": reason, "logprobs": None}, suffix))
            if include_usage:
                out.append({**self._envelope({}, suffix), "choices": [],
                            "usage": self._usage(int(event.get("num_output_tokens", 0)))})
        return out


def serve(triton: str, repository: Path, host: str, port: int) -> None:
    """Serve the OpenAI API for `repository`'s vLLM models, sending requests to Triton at `triton`, until stopped
    (SIGINT or SIGTERM)."""
    models = read_models(repository)
    if not models:
        raise ValueError(f"{repository}: no vLLM model (no */*/{ENGINE_ARGS_FILE}) to serve")
    for model in models.values():  # an unreadable tokenizer stops the server now, not its first request
        model.load()
    web.run_app(Frontend(triton, models).app(), host=host, port=port, print=None, shutdown_timeout=30)
