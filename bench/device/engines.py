"""SmolLM2-135M and a Puzzle child on one NVIDIA GPU with vLLM (CUDA), in BF16 and in vLLM's dynamic FP8.

    python bench/device/engines.py --parent DIR --child DIR --out $OUT/engines.json
        [--concurrency 1 4 16 64] [--new-tokens 64] [--precisions bf16 fp8] [--gpu-memory-utilization 0.3]
        [--eager] [--compilation-config JSON]
    python bench/device/engines.py --write-skeleton MODEL_DIR OUT_DIR     (here, before carrying a model)

For each model and precision, one vLLM engine (`AsyncLLM`, in this process: the device machine may have no
tritonserver, so this measures the engine Triton's vLLM backend runs, without Triton's gRPC hop) with a context
of 512 and max_num_seqs the largest concurrency. BF16 is the checkpoint run in bfloat16; FP8 is vLLM's
`quantization="fp8"`, weights quantized to FP8 when loaded and activations scaled dynamically, from the same
BF16/FP32 checkpoint. At each concurrency, max(8, 2 x concurrency) requests, that many at a time, of
`--prompt-tokens` token ids each ask for exactly `--new-tokens` tokens (greedy, ignore_eos), streamed token by
token (RequestOutputKind.DELTA): output tokens/s over the run, time to first token (TTFT) and inter-token
latency (ITL, the gaps between streamed outputs) at p50/p99, measured where the requests are sent. Ratios from
the same run: child/parent per precision, fp8/bf16 per model.

The prompts are seeded pseudo-random token ids (no text is carried to the device); with ignore_eos the work of
a request does not depend on what its tokens say. Imports only vLLM, torch and the standard library (nothing
from tailor), and reads nothing from the network: the model folders are carried to the device. The child's
folder needs its `configuration_decilm.py` (loaded with trust_remote_code). A model folder may be a skeleton
(`--write-skeleton`: config, tokenizer and code files, and each safetensors file's header instead of its data, a
few MB to carry instead of hundreds): it is given random BF16 weights of the same names and shapes, which serve
as fast as the real ones. Results are written to `--out`
after each engine, so a run cut short keeps what it measured. bench/device/README.md says how to run it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network on the device: never reach for a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CONTEXT = 512
SEED = 0
HEADER = ".header.json"  # a skeleton's stand-in for `<name>.safetensors`: that file's header
Row = dict[str, Any]


@dataclass
class Sample:
    """One streamed request, times from its start in seconds."""

    tokens: int
    arrivals: list[float]  # when each streamed output arrived

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile `q` (0-1) of `values`; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def prompts(model: Path, count: int, length: int) -> list[list[int]]:
    """`count` seeded pseudo-random prompts of `length` token ids below the model's vocabulary size."""
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    generator = random.Random(SEED)
    return [[generator.randrange(vocab) for _ in range(length)] for _ in range(count)]


def read_header(weights: Path) -> dict[str, Any]:
    """A safetensors file's header: each tensor's dtype, shape and byte range."""
    with weights.open("rb") as source:
        size = struct.unpack("<Q", source.read(8))[0]
        header: dict[str, Any] = json.loads(source.read(size))
    return header


def write_skeleton(model: Path, out: Path) -> None:
    """`model` without its weights' data: every other file, and each safetensors file's header."""
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in model.iterdir() if p.is_file()):
        if path.suffix == ".safetensors":
            (out / f"{path.name}{HEADER}").write_text(json.dumps(read_header(path)))
        else:
            shutil.copy2(path, out / path.name)
    print(f"wrote {out}: {sum(p.stat().st_size for p in out.iterdir()) / 2**20:.1f} MiB", file=sys.stderr)


def materialize(skeleton: Path, into: Path) -> Path:
    """A model folder from a skeleton: its files, and random BF16 weights of the headers' names and shapes."""
    import torch

    into.mkdir(parents=True)
    generator = torch.Generator().manual_seed(SEED)
    for path in skeleton.iterdir():
        if not path.name.endswith(HEADER):
            shutil.copy2(path, into / path.name)
            continue
        tensors = {name: spec["shape"] for name, spec in json.loads(path.read_text()).items()
                   if name != "__metadata__"}
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        blobs, offset = [], 0
        for name, shape in tensors.items():
            values = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            blobs.append(values.view(torch.uint8).numpy().tobytes())
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + len(blobs[-1])]}
            offset += len(blobs[-1])
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        with (into / path.name.removesuffix(HEADER)).open("wb") as sink:
            sink.write(struct.pack("<Q", len(encoded)) + encoded)
            for blob in blobs:
                sink.write(blob)
    return into


def is_skeleton(model: Path) -> bool:
    return any(model.glob(f"*{HEADER}")) and not any(model.glob("*.safetensors"))


def start_engine(model: Path, precision: str, args: argparse.Namespace) -> Any:
    """A vLLM AsyncLLM for `model` in `precision` (bf16, or fp8: vLLM's dynamic FP8 from the same checkpoint)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    options: dict[str, Any] = {
        "model": str(model), "tokenizer": str(model), "dtype": "bfloat16", "max_model_len": CONTEXT,
        "max_num_seqs": max(args.concurrency), "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.eager, "trust_remote_code": True, "seed": SEED, "disable_log_stats": True,
        "quantization": "fp8" if precision == "fp8" else None}
    if args.compilation_config:
        options["compilation_config"] = json.loads(args.compilation_config)
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**options))


async def request(engine: Any, ids: list[int], new_tokens: int, request_id: str) -> Sample:
    """One greedy request for exactly `new_tokens` tokens, streamed; when each output arrived."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                              output_kind=RequestOutputKind.DELTA)
    arrivals: list[float] = []
    tokens = 0
    started = time.perf_counter()
    async for output in engine.generate({"prompt_token_ids": ids}, sampling, request_id):
        count = len(output.outputs[0].token_ids)
        if count:
            arrivals.append(time.perf_counter() - started)
            tokens += count
    if tokens != new_tokens:
        raise RuntimeError(f"request {request_id}: {tokens} tokens, asked for {new_tokens}")
    return Sample(tokens, arrivals)


async def sweep(engine: Any, prompt_ids: list[list[int]], concurrency: int, new_tokens: int, tag: str) -> Row:
    """max(8, 2 x concurrency) requests, `concurrency` at a time: throughput, TTFT and ITL."""
    requests = max(8, 2 * concurrency)
    slots = asyncio.Semaphore(concurrency)

    async def one(index: int) -> Sample:
        async with slots:
            return await request(engine, prompt_ids[index % len(prompt_ids)], new_tokens, f"{tag}-{index}")

    started = time.perf_counter()
    samples = await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.perf_counter() - started
    ttfts = [s.arrivals[0] for s in samples]
    gaps = [gap for s in samples for gap in s.gaps]
    return {"concurrency": concurrency, "requests": requests, "wall_s": wall,
            "tokens_per_second": sum(s.tokens for s in samples) / wall,
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "itl_p50_s": percentile(gaps, 0.5), "itl_p99_s": percentile(gaps, 0.99),
            "outputs_per_request": sum(len(s.arrivals) for s in samples) / requests}


async def measure(label: str, model: Path, precision: str, args: argparse.Namespace) -> tuple[list[Row], Row]:
    """One engine: started, warmed up, swept over the concurrencies, shut down. Its rows and its start-up."""
    started = time.perf_counter()
    engine = start_engine(model, precision, args)
    startup = {"model": label, "precision": precision, "startup_s": time.perf_counter() - started}
    print(f"{label} {precision}: engine ready in {startup['startup_s']:.0f} s", file=sys.stderr, flush=True)
    rows = []
    try:
        prompt_ids = prompts(model, 64, args.prompt_tokens)
        await sweep(engine, prompt_ids, max(args.concurrency), 4, f"{label}-{precision}-warmup")
        for concurrency in args.concurrency:
            tag = f"{label}-{precision}-{concurrency}"
            row = {"model": label, "precision": precision,
                   **await sweep(engine, prompt_ids, concurrency, args.new_tokens, tag)}
            rows.append(row)
            print(f"{label:<7} {precision:<5} c={concurrency:<3} {row['tokens_per_second']:9.1f} tok/s  "
                  f"TTFT p50 {row['ttft_p50_s'] * 1e3:7.1f} ms  ITL p50 "
                  f"{(row['itl_p50_s'] or 0) * 1e3:6.2f} ms", file=sys.stderr, flush=True)
    finally:
        engine.shutdown()
    return rows, startup


def add_ratios(rows: list[Row]) -> None:
    """child/parent within each precision, fp8/bf16 for each model, at the same concurrency."""
    def tokens_per_second(model: str, precision: str, concurrency: int) -> float | None:
        return next((r["tokens_per_second"] for r in rows
                     if (r["model"], r["precision"], r["concurrency"]) == (model, precision, concurrency)), None)

    for row in rows:
        parent = tokens_per_second("parent", row["precision"], row["concurrency"])
        bf16 = tokens_per_second(row["model"], "bf16", row["concurrency"])
        row["over_parent"] = row["tokens_per_second"] / parent if parent else None
        row["fp8_over_bf16"] = row["tokens_per_second"] / bf16 if bf16 and row["precision"] == "fp8" else None


def markdown(rows: list[Row], device: str) -> str:
    def cell(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}"

    lines = [f"vLLM (CUDA) on {device}.", "",
             "| model | precision | concurrency | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
             "| x parent | fp8 / bf16 |", "|---" * 10 + "|"]
    lines += [f"| {r['model']} | {r['precision']} | {r['concurrency']} | {r['tokens_per_second']:.1f} | "
              f"{cell(r['ttft_p50_s'], 1e3, 1)} | {cell(r['ttft_p99_s'], 1e3, 1)} | {cell(r['itl_p50_s'], 1e3)} | "
              f"{cell(r['itl_p99_s'], 1e3)} | {cell(r['over_parent'])} | {cell(r['fp8_over_bf16'])} |"
              for r in rows]
    return "\n".join(lines)


def environment() -> dict[str, str]:
    import torch
    import vllm

    return {"device": torch.cuda.get_device_name(0), "vllm": vllm.__version__, "torch": torch.__version__,
            "cuda": str(torch.version.cuda)}


def write(out: Path, settings: dict[str, Any], rows: list[Row], startups: list[Row], errors: list[Row]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**settings, "startups": startups, "errors": errors, "rows": rows}, indent=2) + "\n")


async def run(args: argparse.Namespace, scratch: Path) -> int:
    models = {label: materialize(folder, scratch / label) if is_skeleton(folder) else folder
              for label, folder in (("parent", args.parent), ("child", args.child))}
    settings = {**environment(), "context": CONTEXT, "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens, "concurrency": args.concurrency, "eager": args.eager,
                "compilation_config": args.compilation_config, "models": {k: str(v) for k, v in models.items()},
                "random_weights": [k for k, v in models.items() if v.is_relative_to(scratch)]}
    print(f"measuring on {settings['device']} with vLLM {settings['vllm']}, torch {settings['torch']}",
          file=sys.stderr, flush=True)
    rows: list[Row] = []
    startups: list[Row] = []
    errors: list[Row] = []
    for precision in args.precisions:
        for label, model in models.items():
            try:
                measured, startup = await measure(label, model, precision, args)
            except Exception as error:  # one engine that fails leaves the others to run
                traceback.print_exc()
                errors.append({"model": label, "precision": precision, "error": f"{type(error).__name__}: {error}"})
                continue
            rows += measured
            startups.append(startup)
            add_ratios(rows)
            write(args.out, settings, rows, startups, errors)
    add_ratios(rows)
    write(args.out, settings, rows, startups, errors)
    print(markdown(rows, settings["device"]))
    for failed in errors:
        print(f"\n{failed['model']} {failed['precision']} did not run: {failed['error']}")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 1 if errors else 0


def folder(value: str) -> Path:
    path = Path(value).resolve()
    if not (path / "config.json").exists():
        raise argparse.ArgumentTypeError(f"{path}: no config.json (carry the model folder to the device)")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parent", type=folder, help="SmolLM2-135M's Hugging Face folder, or its skeleton")
    parser.add_argument("--child", type=folder, help="a Puzzle child's folder (DeciLM), or its skeleton")
    parser.add_argument("--out", type=Path, help="the JSON results file to write")
    parser.add_argument("--write-skeleton", nargs=2, type=Path, metavar=("MODEL", "OUT"),
                        help="write MODEL's skeleton to OUT (no weights' data) and stop; needs no vLLM")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--precisions", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="each engine's share of GPU memory (weights, activations, KV cache)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile and no CUDA graphs (starts faster)")
    parser.add_argument("--compilation-config", help="vLLM's compilation_config, as JSON")
    args = parser.parse_args()
    if args.write_skeleton:
        write_skeleton(*args.write_skeleton)
        return 0
    if None in (args.parent, args.child, args.out):
        parser.error("--parent, --child and --out are needed")
    args.concurrency = sorted(set(args.concurrency))
    if args.prompt_tokens + args.new_tokens > CONTEXT:
        parser.error(f"--prompt-tokens plus --new-tokens must fit the context of {CONTEXT}")
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit("vllm is not importable here: the device image has torch but no vLLM; carry it as wheels "
                         "(bench/device/README.md)") from None
    with tempfile.TemporaryDirectory(prefix="engines-") as scratch:
        return asyncio.run(run(args, Path(scratch)))


if __name__ == "__main__":  # vLLM may start its engine and workers with spawn: they import this module again
    sys.exit(main())
