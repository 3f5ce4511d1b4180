"""The OpenAI-compatible API (`tailor openai`, as a process of its own beside a real tritonserver running tailor's
vLLM backend, as in a pool's pod), used through the official `openai` client: models, completions, chat with the
tokenizer's template, streaming, and errors in OpenAI's shape."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tailor.compressor.puzzle.pipeline import resolve_parent
from tailor.compressor.serving import client
from tailor.compressor.serving.repository import package
from tailor.compressor.serving.server import RunningServer, triton_server
from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.devcluster.executor import free_port

NAME = "smollm2"
CONTEXT = 512
GREEDY = {"max_tokens": 8, "temperature": 0}
pytestmark = pytest.mark.timeout(900)  # the first test starts tritonserver with a vLLM engine on two cores


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("openai-package")
    package(resolve_parent("smollm2-135m"), out, NAME, GpuCatalog.load().get("cpu"), CONTEXT, max_batch_size=4)
    return out / "repository"


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[RunningServer]:
    with triton_server(repository, timeout=600) as running:
        yield running


@pytest.fixture(scope="module")
def api(server: RunningServer, repository: Path) -> Iterator[openai.OpenAI]:
    port, log = free_port(), repository.parent / "openai.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "tailor.cli.main", "openai",
                                    f"--model-repository={repository}", f"--triton-port={server.ports.http}",
                                    f"--openai-port={port}", "--bind=127.0.0.1"], stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                assert json.loads(reply.read()) == {"ready": True}
                break
        except (urllib.error.URLError, ConnectionError):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as api:
        yield api
    process.terminate()
    assert process.wait(30) == 0, log.read_text()  # it stops cleanly on SIGTERM


def test_models_are_the_repositorys(api: openai.OpenAI) -> None:
    assert [model.id for model in api.models.list()] == [NAME]


def test_a_completion_is_tritons_completion(api: openai.OpenAI, server: RunningServer) -> None:
    prompt = "The capital of France is"
    done = api.completions.create(model=NAME, prompt=prompt, extra_body={"ignore_eos": True}, **GREEDY)
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    assert done.choices[0].text == client.generate(server.grpc_url, NAME, prompt, {**GREEDY, "ignore_eos": True}).text
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert done.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(resolve_parent("smollm2-135m")).encode(
        prompt, add_special_tokens=False))


def test_chat_uses_the_tokenizers_template(api: openai.OpenAI, server: RunningServer) -> None:
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "What is the capital of France?"}]
    done = api.chat.completions.create(model=NAME, messages=messages, **GREEDY)  # type: ignore[arg-type]
    templated = AutoTokenizer.from_pretrained(resolve_parent("smollm2-135m")).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    expected = client.generate(server.grpc_url, NAME, templated, GREEDY)
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == expected.text
    assert done.choices[0].finish_reason == expected.finish_reason


def test_streams_are_server_sent_events_that_add_up(api: openai.OpenAI) -> None:
    prompt = "ROMEO: But soft, what light"
    whole = api.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    chunks = list(api.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 12
    messages = [{"role": "user", "content": "Say hello."}]
    chat = api.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    streamed = list(api.chat.completions.create(model=NAME, messages=messages, max_tokens=6,  # type: ignore[arg-type]
                                                temperature=0, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content


@pytest.mark.parametrize(("request_fields", "status", "expected"), [
    ({"model": NAME, "prompt": "Hi", "top_p": 7}, 400, "top_p must be in"),
    ({"model": NAME, "prompt": "Hi", "beam_width": 4}, 400, "Unrecognized request argument supplied: beam_width"),
    ({"model": NAME, "prompt": "Hi", "n": 2}, 400, "n must be 1"),
    ({"model": NAME, "prompt": "Hi", "logprobs": 5}, 400, "logprobs is not supported"),
    ({"model": NAME, "prompt": ["a", "b"]}, 400, "prompt must be a string"),
    ({"model": NAME, "prompt": "ROMEO " * CONTEXT}, 400, f"maximum context length is {CONTEXT} tokens"),
    ({"model": "gpt-5", "prompt": "Hi"}, 404, "The model `gpt-5` does not exist"),
])
def test_a_bad_request_is_answered_in_openais_error_shape(api: openai.OpenAI, request_fields: dict[str, object],
                                                          status: int, expected: str) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        api.post("/completions", body=request_fields, cast_to=dict)
    assert raised.value.status_code == status
    error = raised.value.body
    assert isinstance(error, dict) and expected in error["message"], error
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}


def test_a_request_that_is_not_json_is_refused(api: openai.OpenAI) -> None:
    request = urllib.request.Request(f"{api.base_url}completions", data=b"{nope", method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    with raised.value as error:
        assert error.code == 400 and "not JSON" in json.loads(error.read())["error"]["message"]
