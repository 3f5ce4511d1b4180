"""Triton with vLLM (its CPU build, through tailor's vLLM backend) serving SmolLM2 and its Puzzle child: token
parity with the project's own decoder, the engine's KV-cache accounting against the sizing, streaming,
per-request errors, cancellation and vLLM's metrics on Triton's metrics port.

One server with both models is shared by the module (each vLLM engine takes ~30 s to start on two cores).
"""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tailor.compressor.puzzle.pipeline import resolve_parent
from tailor.compressor.serving import client
from tailor.compressor.serving.generation import Generator
from tailor.compressor.serving.repository import VLLM_BACKEND, PackageSettings, package
from tailor.compressor.serving.server import RunningServer, triton_server
from tailor.compressor.sizing.engines import Engine
from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.operator.deployment import POD_METRICS

from served import adapter_series, decoder_greedy, vllm_greedy

BATCH = 8  # max_num_seqs: room for the eight requests of the isolation test
CONTEXT = 1024  # pages of 128 tokens: the page vLLM keeps back is 1/8 of a request, 1.6% of 8 requests
PROMPTS = ["ROMEO: But soft, what light through yonder window breaks?", "The capital of France is",
           "HAMLET: To be, or not to be, that is the question:"]
pytestmark = pytest.mark.timeout(900)  # the first test starts the shared server: two vLLM engines on two cores


@pytest.fixture(scope="module")
def models(quantized_child: Path) -> dict[str, Path]:
    """The parent and its BF16 Puzzle child (the compress stage's output, before quantization)."""
    return {"parent": resolve_parent("smollm2-135m"), "child": quantized_child.parent / "run" / "child"}


@pytest.fixture(scope="module")
def packages(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, PackageSettings]:
    work = tmp_path_factory.mktemp("vllm-packages")
    cpu = GpuCatalog.load().get("cpu")
    return {name: package(folder, work / name, name, cpu, CONTEXT, max_batch_size=BATCH)
            for name, folder in models.items()}


@pytest.fixture(scope="module")
def server(packages: dict[str, PackageSettings], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("vllm-repository")
    for name in packages:
        (repository / name).symlink_to(Path(packages[name].engine_args["model"]).parent.parent)  # type: ignore[index]
    with triton_server(repository, timeout=600) as running:
        yield running


def metrics(server: RunningServer, name: str, model: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(f"{name}{{") and f'model="{model}"' in line)


def test_the_package_carries_tailors_backend_and_its_engine_arguments(packages: dict[str, PackageSettings]) -> None:
    """The model runs on Triton's Python backend with tailor's vLLM backend as its model.py, byte for byte: the code
    every server runs on it, this one and a GPU pool's."""
    settings = packages["child"]
    root = Path(settings.engine_args["model"]).parent  # type: ignore[index]
    config = (root.parent / "config.pbtxt").read_text()
    assert 'backend: "python"' in config and "decoupled: true" in config
    assert (root / "model.py").read_bytes() == VLLM_BACKEND.read_bytes()
    args = json.loads((root / "model.json").read_text())
    assert args["max_num_seqs"] == BATCH and args["max_model_len"] == CONTEXT
    pages = CONTEXT // 128  # whole pages per request, and the one page vLLM keeps back
    assert args["kv_cache_memory_bytes"] == (BATCH * pages + 1) * settings.sizing.footprint.per_request // pages
    assert (root / "checkpoint" / "configuration_decilm.py").exists()  # the child's config class travels with it


def test_vllm_decodes_what_the_projects_decoder_decodes(models: dict[str, Path], tmp_path: Path) -> None:
    """Greedy tokens of vLLM (fp32, its offline engine) and of the project's Decoder agree, parent and child."""
    generators = {name: Generator(folder, CONTEXT, torch.float32) for name, folder in models.items()}
    prompts = [generators["parent"].encode(text) for text in PROMPTS]
    answers = vllm_greedy(list(models.values()), prompts, 16, CONTEXT, tmp_path)
    for (name, generator), answer in zip(generators.items(), answers, strict=True):
        assert answer == decoder_greedy(generator, prompts, 16), name


def test_the_engines_own_concurrency_is_the_sizings(server: RunningServer,
                                                    packages: dict[str, PackageSettings]) -> None:
    """Given the memory the sizing reserves for BATCH requests, vLLM reports it holds BATCH (within 5%; it counts
    the page it keeps back): its bytes per token are the memory model's, for the parent and for the child with its
    own layer shapes."""
    for name, settings in packages.items():
        reported = metrics(server, "tailor_engine_max_concurrency", name)
        assert abs(reported - settings.max_batch_size) <= 0.05 * settings.max_batch_size, (name, reported)


def test_completions_stream_and_finish(server: RunningServer) -> None:
    sampling = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = client.generate(server.grpc_url, "child", PROMPTS[0], sampling)
    pieces: list[str] = []
    streamed = client.generate(server.grpc_url, "child", PROMPTS[0], sampling, stream=True, on_text=pieces.append)
    assert whole.text == streamed.text == "".join(pieces) and len(pieces) > 1
    assert (whole.finish_reason, whole.output_tokens) == ("length", 12) == (streamed.finish_reason,
                                                                           streamed.output_tokens)
    seeded = [client.generate(server.grpc_url, "parent", PROMPTS[1], {"max_tokens": 8, "temperature": 1.0,
                                                                        "seed": seed}).text for seed in (1, 1, 2)]
    assert seeded[0] == seeded[1] != seeded[2]


@pytest.mark.parametrize(("prompt", "sampling", "expected"), [
    ("", {}, "text_input is empty"),
    ("x" * (CONTEXT * 16 + 1), {}, f"more than the {CONTEXT * 16} this model takes"),
    ("ROMEO " * CONTEXT, {}, f"maximum context length is {CONTEXT} tokens"),
    (PROMPTS[0], {"beam_width": 4}, "sampling_parameters.beam_width is not a field"),
    (PROMPTS[0], {"max_tokens": "many"}, "sampling_parameters.max_tokens must be int"),
    (PROMPTS[0], {"top_p": 7}, "sampling_parameters: top_p must be in"),
    (PROMPTS[0], {"n": 3}, "sampling_parameters.n must be 1"),
])
def test_a_bad_request_gets_a_400_naming_its_input(server: RunningServer, prompt: str, sampling: dict[str, Any],
                                                    expected: str) -> None:
    """Over HTTP (Triton's generate endpoint) a 400; over a gRPC stream the same message."""
    body = json.dumps({"text_input": prompt, "sampling_parameters": json.dumps(sampling)}).encode()
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/parent/generate", data=body)
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=60)
    assert error.value.code == 400 and re.search(expected, error.value.read().decode())
    with pytest.raises(InferenceServerException, match=expected):
        client.generate(server.grpc_url, "parent", prompt, sampling)


def test_requests_batched_with_a_bad_one_are_served(server: RunningServer) -> None:
    """Eight requests at once: a near-zero temperature (vLLM clamps it), an unknown field and a prompt beyond
    the context among them; only the two bad ones fail, each with its own message."""
    good = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    requests = [(PROMPTS[2], good)] * 5 + [(PROMPTS[2], {**good, "temperature": 1e-40}),
                                          (PROMPTS[2], {**good, "bogus": 1}), ("ROMEO " * CONTEXT, good)]
    expected = client.generate(server.grpc_url, "parent", PROMPTS[2], good).text

    def send(request: tuple[str, dict[str, Any]]) -> str:
        try:
            return client.generate(server.grpc_url, "parent", *request).text
        except InferenceServerException as error:
            return f"error: {error.message()}"

    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(send, requests))
    assert answers[:5] == [expected] * 5 and not answers[5].startswith("error")
    assert answers[6].startswith("error") and "bogus" in answers[6]
    assert answers[7].startswith("error") and "maximum context length" in answers[7]


def test_a_client_that_goes_away_frees_its_sequence(server: RunningServer) -> None:
    generated = metrics(server, "vllm:generation_tokens_total", "parent")
    stream = grpcclient.InferenceServerClient(server.grpc_url)
    pieces: queue.Queue[Any] = queue.Queue()
    stream.start_stream(callback=lambda result, error: pieces.put(error or result))
    tensors = []
    for name, value in (("text_input", PROMPTS[0].encode()), ("stream", True),
                        ("sampling_parameters", json.dumps({"max_tokens": 200, "ignore_eos": True}).encode())):
        tensor = grpcclient.InferInput(name, [1], "BYTES" if isinstance(value, bytes) else "BOOL")
        tensor.set_data_from_numpy(np.array([value], dtype=np.object_ if isinstance(value, bytes) else np.bool_))
        tensors.append(tensor)
    stream.async_stream_infer("parent", tensors)
    pieces.get(timeout=120)  # the first token: the request is running
    stream.stop_stream(cancel_requests=True)
    stream.close()
    deadline = time.monotonic() + 60
    while metrics(server, "vllm:num_requests_running", "parent") > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metrics(server, "vllm:num_requests_running", "parent") == 0
    time.sleep(2)
    assert metrics(server, "vllm:generation_tokens_total", "parent") - generated < 200  # it did not run on


def test_every_metric_the_autoscalers_ask_for_is_served(server: RunningServer) -> None:
    """Each series the chart's prometheus-adapter rules read for the vLLM metrics the operator's HPAs name is on
    the metrics port of a server running the packaged backend."""
    client.generate(server.grpc_url, "child", PROMPTS[1], {"max_tokens": 4})
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        served = {line.split("{", 1)[0] for line in response.read().decode().splitlines() if not line.startswith("#")}
    wanted = adapter_series(set(POD_METRICS[Engine.VLLM].values()))
    assert set(wanted) == set(POD_METRICS[Engine.VLLM].values())  # every HPA metric has a rule
    for metric, series in wanted.items():
        assert series <= served, (metric, series - served)


def test_vllms_metrics_are_on_tritons_metrics_port(server: RunningServer) -> None:
    client.generate(server.grpc_url, "child", PROMPTS[1], {"max_tokens": 4})
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count"):
        assert f'{name}{{model="child",version="1"}}' in text
    deadline = time.monotonic() + 10  # recorded by the backend's metrics thread, after the engine's step
    while metrics(server, "vllm:generation_tokens_total", "child") < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metrics(server, "vllm:generation_tokens_total", "child") >= 4


def _nice(stat: str) -> int:
    """The niceness field of a /proc stat line (the 19th; the command name may hold spaces)."""
    return int(stat.rsplit(")", 1)[1].split()[16])


def test_the_engine_runs_niced_below_tritons_health_checks(server: RunningServer) -> None:
    """Triton abandons a model whose Python stub misses a one-second health check during `initialize` (which
    starts the engine): on a busy CPU the engine's processes yield to the stub's threads and tritonserver's."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    stubs = [pid for pid in children.get(server.process.pid, [])
             if "triton_python_backend_stub" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(stubs) == 2  # one per model
    assert _nice(Path(f"/proc/{server.process.pid}/stat").read_text()) == 0
    for stub in stubs:
        threads = {_nice(task.read_text()) for task in Path(f"/proc/{stub}/task").glob("*/stat")}
        assert 0 in threads and 10 in threads  # its own threads, and the engine's event loop thread
        engines = children.get(stub, [])
        assert engines and all(_nice(Path(f"/proc/{pid}/stat").read_text()) == 10 for pid in engines)
