"""`tailor package`, `tailor serve`, `tailor generate` (vLLM), `tailor infer` (the Python fallback engine),
`tailor openai` (an OpenAI-compatible API in front of Triton), `tailor speed` (the served speed-up): a model on a
real Triton Inference Server."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

EXAMPLES = """examples:
  tailor package --model runs/smollm2/child --out runs/smollm2/triton --name smollm2 --gpu cpu --context 2048
  tailor serve runs/smollm2/triton --http-port 8000 --grpc-port 8001 --metrics-port 8002
  tailor generate --url 127.0.0.1:8001 --model smollm2 --prompt "ROMEO:" --max-tokens 32 --stream
  tailor package --engine tailor-python --model runs/smollm2/child-fp8 --out runs/smollm2/fallback --name smollm2
  tailor infer --url 127.0.0.1:8000 --model smollm2 --prompt "ROMEO:" --max-tokens 32    (tailor-python)
  tailor openai --model-repository runs/smollm2/triton/repository --triton-port 8000 --openai-port 9000
"""


def _openai(args: argparse.Namespace) -> int:
    from tailor.compressor.serving.openai_frontend import serve
    from tailor.compressor.serving.repository import repository_of

    serve(f"http://127.0.0.1:{args.triton_port}", repository_of(args.model_repository), args.bind, args.openai_port)
    return 0


def _package(args: argparse.Namespace) -> int:
    from tailor.cli.plans import needs
    from tailor.compressor.buildplan import BuildPlan
    from tailor.compressor.compute import ComputeDtype
    from tailor.compressor.model.device import compute_for_profile
    from tailor.compressor.puzzle.pipeline import resolve_parent
    from tailor.compressor.serving.repository import package
    from tailor.compressor.sizing.engines import Engine
    from tailor.compressor.sizing.hardware import GpuCatalog

    plan = BuildPlan.load(args.plan) if args.plan else None
    if plan is not None:  # the operator sized the pool and computed vLLM's arguments: nothing is re-derived here
        pool = plan.pool
        if pool is None:
            raise ValueError(f"{args.plan}: the build plan names no pool to package for")
        folder = plan.layout.package(pool.generation, pool.name)
        settings = package(Path(plan.checkpoint), Path(plan.layout.root, folder), plan.model,
                           plan.catalog().get(pool.gpu_profile), pool.context, engine=pool.engine,
                           max_batch_size=pool.max_batch_size, instances=args.instances, decoupled=args.stream,
                           threads=args.threads, tensor_parallel=pool.tensor_parallel,
                           sizing=pool.sizing, vllm_args=pool.engine_args)
        if pool.measure_speedup:
            _package_pair(plan)
        if args.result_file is not None:
            _code_result(plan, [folder, plan.layout.speed(pool.generation, pool.name)], args.result_file)
    else:
        needs(args, "model", "out", "name")
        gpu = GpuCatalog.load(args.profiles).get(args.gpu)
        compute = compute_for_profile(gpu.family, ComputeDtype(args.dtype))
        print(f"compute dtype {compute.describe()}", file=sys.stderr)
        settings = package(resolve_parent(args.model), args.out, args.name, gpu, args.context,
                           engine=Engine(args.engine), max_batch_size=args.max_batch_size,
                           instances=args.instances, decoupled=args.stream, threads=args.threads, dtype=compute.dtype,
                           tensor_parallel=args.tensor_parallel, mount=args.mount)
    print(settings.model_dump_json(indent=2))
    return 0


def _code_result(plan: Any, folders: list[str], result_file: Path) -> None:
    """The digests of the code the package's repositories run (`codecheck`), for the operator to record."""
    from tailor.compressor.buildplan import REPOSITORY
    from tailor.compressor.results import PackageResult, write_result
    from tailor.compressor.serving.codecheck import digests

    root = Path(plan.layout.root)
    repositories = [root / folder / REPOSITORY for folder in folders if (root / folder / REPOSITORY).is_dir()]
    write_result(PackageResult(code=digests(root, repositories)), result_file)


def _package_pair(plan: Any) -> None:
    """The unquantized child and the parent side by side for `tailor speed`, in the pool's speed folder."""
    from tailor.compressor.buildplan import repository_in_pod
    from tailor.compressor.puzzle.pipeline import resolve_parent
    from tailor.compressor.serving.speedup import package_pair

    pool = plan.pool
    folder = plan.layout.speed(pool.generation, pool.name)
    reason = package_pair(Path(plan.layout.child), resolve_parent(plan.parent), Path(plan.layout.root, folder),
                          plan.catalog().get(pool.gpu_profile), pool.context, pool.tensor_parallel,
                          repository_in_pod(folder), pool.sizing.dtype)
    print(reason or f"packaged the child and the parent for the served speed-up in {folder}", file=sys.stderr)


def _speed(args: argparse.Namespace) -> int:
    from tailor.cli.plans import write_results
    from tailor.compressor.buildplan import REPOSITORY, BuildPlan
    from tailor.compressor.serving import speedup

    plan = BuildPlan.load(args.plan)
    pool = plan.pool
    if pool is None or not pool.measure_speedup:
        raise ValueError(f"{args.plan}: the build plan names no pool whose speed-up is measured")
    folder = plan.layout.speed(pool.generation, pool.name)
    reason = speedup.skipped(Path(plan.layout.root, folder))
    if reason is None:
        speedup.wait_ready(f"http://127.0.0.1:{args.http_port}", args.timeout)
        pid = speedup.server_pid(f"{folder}/{REPOSITORY}")
        if pid is None:
            raise RuntimeError(f"no tritonserver serving {folder}/{REPOSITORY} is visible from this process (the "
                               "pod must share its process namespace)")
        _, found = speedup.measure(f"127.0.0.1:{args.grpc_port}", pid, lambda row: print(
            f"{row['model']:<6} c={row['concurrency']:<3} round {row['round']} {row['tokens_per_second']:8.1f} tok/s, "
            f"other processes {row['other_cores']:.2f} cores", file=sys.stderr, flush=True))
        result = speedup.result(pool.gpu_profile, pool.context, pool.sizing.dtype, found)
    else:
        result = speedup.result(pool.gpu_profile, pool.context, pool.sizing.dtype, reason=reason)
    write_results(result, args.result_file, plan, "speed")
    print(result.model_dump_json(indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tailor.compressor.serving.repository import repository_of
    from tailor.compressor.serving.server import Ports, triton_server

    ports = Ports(args.http_port, args.grpc_port, args.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with triton_server(repository_of(args.repository), ports, explicit=args.explicit, load=args.load,
                       log=args.log, timeout=args.timeout) as server:
        print(f"tritonserver ready: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url} "
              f"(log {server.log}); Ctrl-C stops it", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            if server.process.poll() is not None:
                print(f"tritonserver exited ({server.process.returncode}):\n{server.log_tail()}", file=sys.stderr)
                return 1
    print("tritonserver stopped", file=sys.stderr)
    return 0


def _tritonserver(args: argparse.Namespace) -> int:
    """Replace this process with the bundled tritonserver (the runtime image's `tritonserver` command)."""
    import os
    import tempfile

    from tailor.compressor.serving.server import local_command

    given = args.args[1:] if args.args[:1] == ["--"] else args.args
    argv, env = local_command(given, Path(tempfile.mkdtemp(prefix="tritonserver-")))
    os.execve(argv[0], argv, {**os.environ, **env})


SAMPLING = {"max_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int}


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags given (`_add_sampling`), by their request names."""
    given = {name: getattr(args, name) for name in SAMPLING} | {"ignore_eos": args.ignore_eos or None}
    return {name: value for name, value in given.items() if value is not None}


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    for name, kind in SAMPLING.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind)
    parser.add_argument("--ignore-eos", action="store_true", help="generate max-tokens whatever comes")


def _client() -> Any:
    """The serving client, which needs Triton's client library (the `compressor` extra)."""
    try:
        from tailor.compressor.serving import client
    except ModuleNotFoundError as missing:
        raise SystemExit(f"error: {missing.name} is not installed: this command needs "
                         "pip install 'tailor[compressor]'") from None
    return client


def _generate(args: argparse.Namespace) -> int:
    client = _client()
    sampling = _sampling(args)
    if args.stream:
        client.generate(args.url, args.model, args.prompt, sampling, stream=True,
                        on_text=lambda text: print(text, end="", flush=True))
        print()
    else:
        print(client.generate(args.url, args.model, args.prompt, sampling).text)
    return 0


def _infer(args: argparse.Namespace) -> int:
    client = _client()

    parameters = _sampling(args)
    ids = [int(t) for t in args.ids.split(",")] if args.ids else None
    prompt = None if ids else args.prompt
    if args.stream:
        if args.protocol != "grpc":
            raise ValueError("--stream needs --protocol grpc (Triton streams decoupled models over gRPC)")
        client.stream(args.url, args.model, lambda text: print(text, end="", flush=True), prompt, ids,
                      **parameters)
        print()
    else:
        print(client.infer(args.url, args.model, args.protocol, prompt, ids, **parameters).text)
    return 0


def add_parsers(nouns: Any) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    pack = nouns.add_parser("package", help="write a Triton model repository for a checkpoint", epilog=EXAMPLES,
                            formatter_class=formatter)
    pack.add_argument("--plan", type=Path, help="a build plan with a pool (what the operator's package Jobs read): "
                                                "checkpoint, folder, name, GPU and the pool's sizing from it")
    pack.add_argument("--model", help="checkpoint folder (quantized or not), or smollm2-135m")
    pack.add_argument("--out", type=Path, help="package folder to write")
    pack.add_argument("--name", help="the model's name on the server")
    pack.add_argument("--gpu", default="cpu", help="profile the repository is sized for (cpu: KIND_CPU)")
    pack.add_argument("--profiles", type=Path, help="YAML file overriding or adding GPU profiles")
    pack.add_argument("--context", type=int, default=2048, help="tokens per request the sizing reserves")
    pack.add_argument("--engine", choices=["vllm", "tailor-python"], default="vllm",
                      help="vllm (Triton's vLLM backend; here vLLM's CPU build) or the Python fallback engine")
    pack.add_argument("--mount", help="where the server finds the repository, for model.json (default: --out's)")
    pack.add_argument("--max-batch-size", type=int, help="default: what the sizing fits (at most 64)")
    pack.add_argument("--instances", type=int, default=1, help="model instances (instance_group count)")
    pack.add_argument("--tensor-parallel", type=int, default=1, help="GPUs per replica the sizing assumes")
    pack.add_argument("--threads", type=int, default=2, help="tailor-python: torch threads per instance")
    pack.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                      help="compute dtype; auto: bfloat16 where the serving device has BF16 math (this CPU for "
                           "--gpu cpu), else float32")
    pack.add_argument("--result-file", type=Path, help="with --plan: also write the digests of the code the "
                                                       "package runs here (a Job's termination log)")
    pack.add_argument("--stream", action="store_true",
                      help="tailor-python: decoupled, one response per token (vllm models always are)")
    pack.set_defaults(run=_package)

    speed = nouns.add_parser("speed", help="the served speed-up: the child's tokens/s over the parent's through the "
                                           "Triton beside this process, interleaved (the operator's speed Job)")
    speed.add_argument("--plan", type=Path, required=True, help="the measured pool's package plan")
    speed.add_argument("--http-port", type=int, default=8000, help="the Triton server's HTTP port on 127.0.0.1")
    speed.add_argument("--grpc-port", type=int, default=8001, help="the Triton server's gRPC port on 127.0.0.1")
    speed.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for both models to load")
    speed.add_argument("--result-file", type=Path, help="also write the JSON result here (a Job's termination log)")
    speed.set_defaults(run=_speed)

    exec_server = nouns.add_parser("tritonserver", help="exec the tritonserver bundled in nvidia-pytriton with "
                                   "its Python backend: tailor tritonserver -- <tritonserver's own arguments>")
    exec_server.add_argument("args", nargs=argparse.REMAINDER, help="tritonserver arguments")
    exec_server.set_defaults(run=_tritonserver)

    serve = nouns.add_parser("serve", help="run tritonserver on 127.0.0.1 until SIGINT/SIGTERM",
                             epilog=EXAMPLES, formatter_class=formatter)
    serve.add_argument("repository", type=Path, help="a `tailor package` folder or a model repository")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--explicit", action="store_true", help="model control mode explicit")
    serve.add_argument("--load", action="append", help="with --explicit: a model to load at start")
    serve.add_argument("--log", type=Path, help="server log file (default: a temporary folder)")
    serve.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    serve.set_defaults(run=_serve)

    generate = nouns.add_parser("generate", help="generate through Triton's vLLM backend (gRPC)", epilog=EXAMPLES,
                                formatter_class=formatter)
    generate.add_argument("--url", default="127.0.0.1:8001", help="host:port of Triton's gRPC endpoint")
    generate.add_argument("--model", required=True)
    generate.add_argument("--prompt", required=True)
    _add_sampling(generate)
    generate.add_argument("--stream", action="store_true", help="print the text as it comes")
    generate.set_defaults(run=_generate)

    openai = nouns.add_parser("openai", help="serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                                             "/v1/models) for the vLLM models of a Triton on this host",
                              epilog=EXAMPLES, formatter_class=formatter)
    openai.add_argument("--model-repository", type=Path, required=True,
                        help="the repository the Triton server serves (or its `tailor package` folder)")
    openai.add_argument("--triton-port", type=int, default=8000, help="the Triton server's HTTP port on 127.0.0.1")
    openai.add_argument("--openai-port", type=int, default=9000, help="the port to serve the API on")
    openai.add_argument("--bind", default="0.0.0.0", help="the address to serve the API on")
    openai.set_defaults(run=_openai)
    infer = nouns.add_parser("infer", help="generate through the Python fallback engine (tailor-python)",
                             epilog=EXAMPLES, formatter_class=formatter)
    infer.add_argument("--url", default="127.0.0.1:8000", help="host:port (8000 HTTP, 8001 gRPC by default)")
    infer.add_argument("--protocol", choices=["http", "grpc"], default="http")
    infer.add_argument("--model", required=True)
    source = infer.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt")
    source.add_argument("--ids", help="comma-separated token ids instead of a prompt")
    _add_sampling(infer)
    infer.add_argument("--stream", action="store_true", help="stream tokens (gRPC, a --stream package)")
    infer.set_defaults(run=_infer)
