"""A compressed, FP8-quantized SmolLM2 on a real tritonserver: generation over HTTP and gRPC, batching,
streaming, metrics, model control, malformed input, and `tailor serve`'s clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tailor.cli.main import main
from tailor.compressor.model.device import compute_for_profile, torch_dtype
from tailor.compressor.serving import client
from tailor.compressor.serving.generation import GenerationRequest, Generator
from tailor.compressor.serving.server import Ports, RunningServer, triton_server

from served import MAX_BATCH, NAME

PROMPT = "ROMEO: But soft, what light through yonder window breaks?"
SERVED_DTYPE = torch_dtype(compute_for_profile("cpu"))  # what `package` serves the `cpu` profile in here


def metric(server: RunningServer, name: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(f"{name}{{") and f'model="{NAME}"' in line)


def test_generates_what_the_model_generates_locally_over_http_and_grpc(server: RunningServer,
                                                                      quantized_child: Path) -> None:
    over_http = client.infer(server.http_url, NAME, "http", PROMPT, max_tokens=12, ignore_eos=True)
    over_grpc = client.infer(server.grpc_url, NAME, "grpc", PROMPT, max_tokens=12, ignore_eos=True)
    assert over_http == over_grpc and len(over_http.ids) == 12 and over_http.text.strip()
    engine = Generator(quantized_child, 256, SERVED_DTYPE)
    local: list[int] = []
    engine.generate([GenerationRequest(ids=engine.encode(PROMPT), max_tokens=12, ignore_eos=True)],
                    lambda _, token, __: local.append(token))
    assert over_http.ids == local and over_http.text == engine.decode(local)
    sampled = [client.infer(server.http_url, NAME, "http", PROMPT, max_tokens=8, temperature=1.0, top_k=50,
                            top_p=0.9, seed=seed, ignore_eos=True).ids for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]  # the seed decides


def test_tailor_infer_prints_the_completion(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    expected = client.infer(server.http_url, NAME, "http", PROMPT, max_tokens=5, ignore_eos=True).text
    for url, protocol in ((server.http_url, "http"), (server.grpc_url, "grpc")):
        assert main(["infer", "--url", url, "--protocol", protocol, "--model", NAME, "--prompt", PROMPT,
                     "--max-tokens", "5", "--ignore-eos"]) == 0
        assert capsys.readouterr().out == expected + "\n"
    assert main(["infer", "--url", server.http_url, "--model", NAME, "--prompt", PROMPT, "--stream"]) == 1
    assert "--stream needs --protocol grpc" in capsys.readouterr().err


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server: RunningServer,
                                                                    quantized_child: Path) -> None:
    engine = Generator(quantized_child, 256, SERVED_DTYPE)
    lines = ["ROMEO: But soft, what light", "JULIET: O Romeo, Romeo, wherefore", "HAMLET: To be, or not to be",
             "MACBETH: Is this a dagger which"]
    prompts = [engine.encode(line)[:6] for line in lines]  # equal lengths: decoded in one batch
    alone = [client.infer(server.http_url, NAME, "http", ids=ids, max_tokens=6 + i, ignore_eos=True).ids
             for i, ids in enumerate(prompts)]
    executions = metric(server, "nv_inference_exec_count")
    with ThreadPoolExecutor(MAX_BATCH) as pool:
        together = list(pool.map(lambda i: client.infer(server.http_url, NAME, "http", ids=prompts[i],
                                                        max_tokens=6 + i, ignore_eos=True).ids, range(MAX_BATCH)))
    assert [len(ids) for ids in together] == [6, 7, 8, 9]
    # Each answer is its own prompt's: the first greedy token (from the prefill) agrees with the one-at-a-time
    # answer. Later tokens may not: batched GEMMs round differently (1e-6), and the FP8 activation rounding of
    # this small child amplifies that into different greedy choices (measured: up to 4 logits apart).
    assert [ids[0] for ids in together] == [ids[0] for ids in alone]
    assert metric(server, "nv_inference_exec_count") - executions < MAX_BATCH  # some requests shared a batch


def test_metrics_count_requests_and_the_queue(server: RunningServer) -> None:
    before = metric(server, "nv_inference_request_success")
    client.infer(server.http_url, NAME, "http", "To be", max_tokens=2)
    assert metric(server, "nv_inference_request_success") == before + 1
    assert metric(server, "nv_inference_pending_request_count") == 0
    assert metric(server, "nv_inference_queue_duration_us") > 0


def _rejects(server: RunningServer, tensors: list[httpclient.InferInput], message: str) -> None:
    """Closes its client here: the failure's traceback holds this frame in a cycle, so an unclosed client would
    be closed by whichever thread next runs the garbage collector, and tritonclient's gevent pool cannot be
    closed from a thread without its hub (CI saw 7 such clients fail a later test's worker threads)."""
    with httpclient.InferenceServerClient(server.http_url) as http, \
            pytest.raises(InferenceServerException, match=message) as raised:
        http.infer(NAME, tensors)
    assert raised.value.status() == "400"


def _tensor(name: str, values: np.ndarray, datatype: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(values.shape), datatype)
    tensor.set_data_from_numpy(values)
    return tensor


def test_malformed_requests_get_a_400_naming_the_problem_and_the_server_stays_ready(server: RunningServer) -> None:
    text = np.array([[PROMPT.encode()]], dtype=np.object_)
    cases = [
        ([_tensor("input_ids", np.array([[1.0, 2.0]], dtype=np.float32), "FP32")], "data-type is 'FP32'"),
        ([_tensor("text_input", np.array([[b"   "]], dtype=np.object_), "BYTES")], "text_input is empty"),
        ([_tensor("input_ids", np.array([[1] * 250], dtype=np.int64), "INT64")],
         "250 tokens and max_tokens is 64: together beyond the context length of 256"),
        ([_tensor("text_input", np.repeat(text, MAX_BATCH + 1, 0), "BYTES")], f"must be <= {MAX_BATCH}"),
        ([_tensor("text_input", text, "BYTES"), _tensor("input_ids", np.array([[1]], dtype=np.int64), "INT64")],
         "exactly one of text_input"),
        ([_tensor("input_ids", np.array([[5, 10**9]], dtype=np.int64), "INT64")], "input_ids must lie in"),
        ([_tensor("text_input", text, "BYTES"), _tensor("top_p", np.array([[0.0]], dtype=np.float32), "FP32")],
         "top_p: Input should be greater than 0"),
    ]
    for tensors, message in cases:
        _rejects(server, tensors, message)
        assert server.ready()
    assert client.infer(server.http_url, NAME, "http", PROMPT, max_tokens=3).ids


def test_a_near_zero_temperature_among_good_requests_fails_nothing(server: RunningServer) -> None:
    """It samples as temperature 0.01 (as vLLM does): dividing the logits by 1e-40 would overflow the batch."""
    good = {"max_tokens": 4, "ignore_eos": True}
    with ThreadPoolExecutor(MAX_BATCH) as pool:
        answers = list(pool.map(lambda t: client.infer(server.http_url, NAME, "http", PROMPT, temperature=t, seed=1,
                                                       **good).ids, [0.0] * (MAX_BATCH - 1) + [1e-40]))
    assert all(len(ids) == 4 for ids in answers)


def test_streaming_and_explicit_model_control(streaming_package: Path) -> None:
    with triton_server(streaming_package / "repository", explicit=True) as running:
        control = grpcclient.InferenceServerClient(running.grpc_url)
        assert not control.is_model_ready(NAME)
        control.load_model(NAME)
        assert control.is_model_ready(NAME)
        pieces: list[str] = []
        streamed = client.stream(running.grpc_url, NAME, pieces.append, PROMPT, max_tokens=10, ignore_eos=True)
        assert len(pieces) == 10 == len(streamed.ids) and "".join(pieces) == streamed.text
        assert main(["infer", "--url", running.grpc_url, "--protocol", "grpc", "--stream", "--model", NAME,
                     "--prompt", PROMPT, "--max-tokens", "10", "--ignore-eos"]) == 0
        with pytest.raises(InferenceServerException, match="doesn't support models with decoupled"):
            client.infer(running.http_url, NAME, "http", PROMPT, max_tokens=2)
        control.unload_model(NAME)
        deadline = time.monotonic() + 30
        while control.is_model_ready(NAME) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not control.is_model_ready(NAME) and control.is_server_live()


def _listening_on(http_port: int) -> list[str]:
    """The processes started with `--http-port=<http_port>` (as tritonserver is), as `pgrep -a` lists them.
    `--` ends pgrep's own options: the pattern is otherwise read as one, pgrep fails with status 2 and prints
    nothing, which would pass for "none running"."""
    found = subprocess.run(["pgrep", "-a", "-f", "--", f"--http-port={http_port}( |$)"], capture_output=True,
                           text=True)
    assert found.returncode in (0, 1), f"pgrep failed with status {found.returncode}: {found.stderr}"
    return found.stdout.splitlines()


def test_tailor_serve_runs_until_sigterm_and_stops_cleanly(packaged: Path) -> None:
    ports = Ports.free()
    command = [sys.executable, "-m", "tailor.cli.main", "serve", str(packaged), "--http-port", str(ports.http),
               "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics)]
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as process:
        try:
            assert process.stderr is not None
            banner = process.stderr.readline()
            assert "tritonserver ready" in banner, banner
            assert client.infer(f"127.0.0.1:{ports.http}", NAME, "http", "To be", max_tokens=2).ids
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 0
            assert "tritonserver stopped" in process.stderr.read()
            assert _listening_on(ports.http) == [], "tritonserver still running"
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
