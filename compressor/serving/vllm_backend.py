"""Tailor's vLLM backend for Triton: the `model.py` of every vLLM model `tailor package` writes, run by Triton's
Python backend on every server (Tailor's serving image on GPU pools, the devcluster's tritonserver here), with
the vLLM of serving.toml.

It speaks the request interface of NVIDIA's vLLM backend for Triton (`text_input`, `stream`,
`sampling_parameters`, ...) and reads the engine arguments from `<version>/model.json`. NVIDIA's backend is not
used because it reports none of vLLM's scheduler statistics, which the pools' autoscalers scale on.

- Requests join vLLM's running batch as they arrive (its async engine, on an event loop in a thread of
  this process); with `stream` each piece of text is its own response. A request whose client goes away is
  aborted in the engine, which frees its sequence and KV blocks.
- Each request's problem is its own: a prompt that is empty, not UTF-8 or beyond `max_prompt_bytes`
  (checked before tokenizing), sampling parameters that are not a JSON object of known fields, or what vLLM
  refuses (a prompt longer than `max_model_len`, say), get an INVALID_ARG error (HTTP 400)
  naming the input; the requests batched with it are untouched.
- vLLM's scheduler and request statistics are reported on Triton's metrics port under vLLM's own names
  (`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, token counters and
  latency histograms), labelled with the model and version; a thread of their own records them, off the
  engine's output loop.

Runs inside the Python backend's stub: imports only the standard library, numpy, vLLM and
`triton_python_backend_utils`, since its environment is the serving image's (vLLM's), not tailor's.
`model.json`'s `model` names the checkpoint where a pod mounts it; a server that mounts the repository elsewhere
(the devcluster's executor) finds the `checkpoint` folder that `tailor package` puts beside `model.json`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import locale
import os
import queue
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

FINALIZE_WAIT_S = 600  # the longest an unload waits for the requests in the engine (drainSeconds' default)
IPC_FOLDER_MAX = 64  # the socket names vLLM adds are 37 characters (a slash and a UUID)
ENGINE_NICE_VARIABLE = "TAILOR_ENGINE_NICE"  # the engine's niceness (CPU pools): Triton's health checks come first

# The stub's embedded interpreter keeps the C locale, so files open as ASCII; torch reads its kernel templates
# (UTF-8) with the default encoding when vLLM imports it.
locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
# vLLM's processes talk over ZMQ IPC sockets under $TMPDIR, and a socket's path must fit in 107 bytes: where the
# temporary folder leaves no room for a socket's name (a devcluster pod's), they get a short folder of their own.
if len(tempfile.gettempdir()) > IPC_FOLDER_MAX and "VLLM_RPC_BASE_PATH" not in os.environ:
    os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="vllm-rpc-", dir="/tmp")

from vllm import SamplingParams  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.exceptions import VLLMClientError  # noqa: E402  # what vLLM refuses about a request
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: E402

ENGINE_ARGS_FILE = "model.json"  # engines.ENGINE_ARGS_FILE (this file imports nothing of tailor's)
# sampling_parameters fields a request may set; anything else is refused by name
SAMPLING_FIELDS = {"max_tokens": int, "min_tokens": int, "temperature": float, "top_p": float, "top_k": int,
                   "min_p": float, "seed": int, "ignore_eos": bool, "stop": list, "presence_penalty": float,
                   "frequency_penalty": float, "repetition_penalty": float, "n": int}
BYTES_PER_TOKEN_BOUND = 16  # default prompt bound: this many bytes per token of max_model_len
LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0]


class RequestError(ValueError):
    """A request that cannot be served, named by its input."""


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        self.config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.config):
            raise pb_utils.TritonModelException("the vllm backend needs model_transaction_policy { decoupled: true }")
        version = Path(args["model_repository"]) / args["model_version"]
        engine_args = json.loads((version / ENGINE_ARGS_FILE).read_text())
        if not Path(engine_args["model"]).exists() and (version / "checkpoint").is_dir():
            engine_args.update(model=str(version / "checkpoint"), tokenizer=str(version / "checkpoint"))
        parameters = {k: v["string_value"] for k, v in self.config.get("parameters", {}).items()}
        self.max_model_len = int(engine_args["max_model_len"])
        self.max_prompt_bytes = int(parameters.get("max_prompt_bytes", self.max_model_len * BYTES_PER_TOKEN_BOUND))
        self.name = args["model_name"]
        labels = {"model": self.name, "version": args["model_version"]}
        self.metrics: list[TritonMetrics] = []  # the engine's stat loggers, closed after it
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-engine", daemon=True)
        self.thread.start()

        async def start() -> AsyncLLM:  # on the loop's thread, where its output handler runs
            # Linux nices a thread, and the processes it starts: the engine's, not the stub's health thread
            os.nice(int(os.environ.get(ENGINE_NICE_VARIABLE, "0")))
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args), stat_loggers=[
                lambda config, index=0: self._metrics(labels)])

        self.engine = asyncio.run_coroutine_threadsafe(start(), self.loop).result()
        self.capacity = engine_capacity(self.engine, labels)
        self.pending: set[concurrent.futures.Future[None]] = set()  # requests in the engine, finished at the end

    def execute(self, requests: list[Any]) -> None:
        """Hand each request to the engine; responses go out through each request's sender."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt, sampling, stream, exclude_prompt, extras = self._parse(request)
            except RequestError as error:
                self._fail(sender, f"{self.name}: {error}", pb_utils.TritonError.INVALID_ARG)
                continue
            except Exception as error:
                self._fail(sender, f"{self.name}: {type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL)
                continue
            future = asyncio.run_coroutine_threadsafe(
                self._generate(request, sender, prompt, sampling, stream, exclude_prompt, extras), self.loop)
            self.pending.add(future)
            future.add_done_callback(self.pending.discard)

    def _parse(self, request: Any) -> tuple[str, SamplingParams, bool, bool, set[str]]:
        text = pb_utils.get_input_tensor_by_name(request, "text_input")
        if text is None:
            raise RequestError("text_input is missing: send the prompt")
        values = text.as_numpy().reshape(-1)
        if values.size != 1:
            raise RequestError(f"text_input must hold one prompt, got {values.size}")
        raw = values[0] if isinstance(values[0], bytes) else str(values[0]).encode()
        if len(raw) > self.max_prompt_bytes:
            raise RequestError(f"text_input has {len(raw)} bytes, more than the {self.max_prompt_bytes} this model "
                               f"takes (max_model_len {self.max_model_len})")
        try:
            prompt = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise RequestError(f"text_input is not UTF-8 ({error.reason} at byte {error.start})") from None
        if not prompt.strip():
            raise RequestError("text_input is empty: send a non-empty prompt")
        stream, exclude = self._flag(request, "stream"), self._flag(request, "exclude_input_in_output")
        extras = {name for name in ("return_finish_reason", "return_num_output_tokens") if self._flag(request, name)}
        return prompt, self._sampling(request), stream, stream or exclude, extras

    @staticmethod
    def _flag(request: Any, name: str) -> bool:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return bool(tensor.as_numpy().reshape(-1)[0]) if tensor is not None else False

    @staticmethod
    def _sampling(request: Any) -> SamplingParams:
        """sampling_parameters (a JSON object of SAMPLING_FIELDS) as vLLM's SamplingParams, checked."""
        tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
        fields: dict[str, Any] = {}
        if tensor is not None:
            raw = tensor.as_numpy().reshape(-1)[0]
            try:
                fields = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else str(raw))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise RequestError(f"sampling_parameters is not JSON: {error}") from None
            if not isinstance(fields, dict):
                raise RequestError(f"sampling_parameters must be a JSON object, got {type(fields).__name__}")
        for name, value in fields.items():
            kind = SAMPLING_FIELDS.get(name)
            if kind is None:
                raise RequestError(f"sampling_parameters.{name} is not a field this server takes; known: "
                                   f"{', '.join(sorted(SAMPLING_FIELDS))}")
            numeric = kind in (int, float) and isinstance(value, int | float) and not isinstance(value, bool)
            if not (isinstance(value, kind) or (kind is float and numeric)):
                raise RequestError(f"sampling_parameters.{name} must be {kind.__name__}, got {value!r}")
        if fields.get("n", 1) != 1:
            raise RequestError("sampling_parameters.n must be 1: send one request per completion")
        try:
            return SamplingParams(**fields)
        except (ValueError, TypeError, VLLMClientError) as error:
            raise RequestError(f"sampling_parameters: {error}") from None

    async def _generate(self, request: Any, sender: Any, prompt: str, sampling: SamplingParams, stream: bool,
                        exclude_prompt: bool, extras: set[str]) -> None:
        """Run one request in the engine; with `stream` each new piece of text is a response, and the final
        response carries what `extras` asks for (empty text when streaming)."""
        del request  # held until here: a request Triton has released cannot be answered
        request_id = uuid.uuid4().hex
        sent = 0  # characters of the completion already streamed
        final = None
        try:
            async for output in self.engine.generate(prompt, sampling, request_id):
                if sender.is_cancelled():  # the client went away: free its sequence and KV blocks
                    await self.engine.abort(request_id)
                    return
                final = output.outputs[0]
                if stream and len(final.text) > sent:
                    sender.send(self._response(final.text[sent:], final, set()))
                    sent = len(final.text)
            assert final is not None
            text = "" if stream else final.text if exclude_prompt else prompt + final.text
            if stream and not extras:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(self._response(text, final, extras), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except asyncio.CancelledError:
            await self.engine.abort(request_id)
            raise
        except (ValueError, VLLMClientError) as error:  # what vLLM refuses about this request (its length, say)
            self._fail(sender, f"{self.name}: {error}", pb_utils.TritonError.INVALID_ARG)
        except Exception as error:
            self._fail(sender, f"{self.name}: {type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL)

    @staticmethod
    def _fail(sender: Any, message: str, code: Any) -> None:
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @staticmethod
    def _response(text: str, completion: Any, extras: set[str]) -> Any:
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if "return_finish_reason" in extras:
            reason = str(completion.finish_reason or "").encode()
            tensors.append(pb_utils.Tensor("finish_reason", np.array([reason], dtype=np.object_)))
        if "return_num_output_tokens" in extras:
            tensors.append(pb_utils.Tensor("num_output_tokens",
                                           np.array([len(completion.token_ids)], dtype=np.uint32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self) -> None:
        """The model is unloaded (the server stops, its pod drained, or an unload): the requests in the engine
        finish first, since Triton may count a decoupled request done once its request object is released. The
        server's `--exit-timeout-secs` and the pod's grace period bound the wait, and FINALIZE_WAIT_S an unload's;
        what is left then is cancelled."""
        if self.pending:
            pb_utils.Logger.log_info(f"{self.name}: finishing {len(self.pending)} request(s) before unloading")
            concurrent.futures.wait(list(self.pending), timeout=FINALIZE_WAIT_S)
        for future in list(self.pending):
            future.cancel()
        self.engine.shutdown()
        for metrics in self.metrics:
            metrics.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def _metrics(self, labels: dict[str, str]) -> TritonMetrics:
        self.metrics.append(TritonMetrics(labels))
        return self.metrics[-1]


def engine_capacity(engine: AsyncLLM, labels: dict[str, str]) -> list[Any]:
    """The engine's own KV-cache accounting, logged and published as gauges (the families, to keep alive):
    `tailor_engine_kv_cache_tokens` and `tailor_engine_max_concurrency` (requests of max_model_len it holds),
    what the operator's sizing is checked against. Families and metrics are returned: each must stay alive."""
    cache = engine.vllm_config.cache_config  # set by the engine's KV-cache setup (serving.toml's vLLM)
    tokens, concurrency = cache.kv_cache_size_tokens, cache.kv_cache_max_concurrency
    pb_utils.Logger.log_info(f"vLLM KV cache: {tokens} tokens, {concurrency:.2f} requests of "
                             f"{engine.vllm_config.model_config.max_model_len} tokens")
    kept = []
    for name, value, description in (
            ("tailor_engine_kv_cache_tokens", tokens, "Tokens the engine's KV cache holds."),
            ("tailor_engine_max_concurrency", concurrency, "Requests of max_model_len the KV cache holds.")):
        family = pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.GAUGE)
        metric = family.Metric(labels)
        metric.set(value)
        kept += [family, metric]
    return kept


class TritonMetrics(StatLoggerBase):  # type: ignore[misc]  # vLLM is not in the type-checked environment
    """vLLM's scheduler and request statistics as Triton custom metrics, under vLLM's own names. Every update is
    a call from the stub to the Triton server (one per observed latency), so the engine's output loop only queues
    its statistics; a thread of their own records them, in order."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.queued: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._drain, name="vllm-metrics", daemon=True)
        self.families: list[Any] = []  # a family must outlive its metrics

        def family(name: str, kind: Any, description: str) -> Any:
            self.families.append(pb_utils.MetricFamily(name=name, description=description, kind=kind))
            return self.families[-1]

        gauge, counter, histogram = (pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER,
                                     pb_utils.MetricFamily.HISTOGRAM)
        self.running = family("vllm:num_requests_running", gauge, "Requests in the running batch.").Metric(labels)
        self.waiting = family("vllm:num_requests_waiting", gauge, "Requests waiting to be scheduled.").Metric(labels)
        self.kv_usage = family("vllm:kv_cache_usage_perc", gauge, "KV-cache usage, 1 is full.").Metric(labels)
        self.preemptions = family("vllm:num_preemptions_total", counter, "Requests preempted.").Metric(labels)
        self.prompt_tokens = family("vllm:prompt_tokens_total", counter, "Prompt tokens processed.").Metric(labels)
        self.generation_tokens = family("vllm:generation_tokens_total", counter,
                                        "Tokens generated.").Metric(labels)

        def latency(name: str, description: str) -> Any:
            return family(name, histogram, description).Metric(labels, buckets=LATENCY_BUCKETS)

        self.ttft = latency("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = latency("vllm:inter_token_latency_seconds", "Time between tokens of a request.")
        self.e2e = latency("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.")
        self.queue = latency("vllm:request_queue_time_seconds", "Time a request waited before running.")
        self.thread.start()

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        """Called by the engine's output loop after every step: queued, and the loop goes on."""
        self.queued.put((scheduler_stats, iteration_stats))

    def close(self) -> None:
        """Record what is queued, then stop the thread (before the families go)."""
        self.queued.put(None)
        self.thread.join(timeout=10)

    def _drain(self) -> None:
        while (stats := self.queued.get()) is not None:
            try:  # a failure is logged, and the next statistics are recorded
                self._record(*stats)
            except Exception as error:
                pb_utils.Logger.log_error(f"vLLM metrics not recorded: {error}")

    def _record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.running.set(scheduler_stats.num_running_reqs)
            self.waiting.set(scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs)
            self.kv_usage.set(scheduler_stats.kv_cache_usage)
        if iteration_stats is None:
            return
        self.preemptions.increment(iteration_stats.num_preempted_reqs)
        self.prompt_tokens.increment(iteration_stats.num_prompt_tokens)
        self.generation_tokens.increment(iteration_stats.num_generation_tokens)
        for value in iteration_stats.time_to_first_tokens_iter:
            self.ttft.observe(value)
        for value in iteration_stats.inter_token_latencies_iter:
            self.itl.observe(value)
        for finished in iteration_stats.finished_requests:
            self.e2e.observe(finished.e2e_latency)
            self.queue.observe(finished.queued_time)

    def log_engine_initialized(self) -> None:
        pb_utils.Logger.log_info(f"vLLM engine ready at {time.strftime('%H:%M:%S')}")
