"""GKD with the child's training state in host memory (`gkd.offload`) against the same GKD held on the GPU, under
NCCL: the path the CPU machines cannot run (pinned host shards copied in at each gather, gradients copied out,
the clipping's norm reduced on the device, host-held shards gathered for writing, DCP checkpoints of them).

A random Llama parent and a perturbed copy of it as the child are written first (no weights travel). Both runs
train the same steps from the same seed, each saving a checkpoint after every step. Prints and writes JSON: both
runs' losses and their largest difference, the largest weight difference of the two children, and each run's
peak GPU memory (allocator) and seconds per step.

    torchrun --standalone --nproc-per-node 1 bench/device/gkd_offload.py --out $OUT/gkd_offload.json

`--device cpu` runs the same script here (gloo; the shards are in host memory either way, so it checks only
that the script runs and both runs agree).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from tailor.compressor.model.checkpoint import load_decoder, read_config, write_checkpoint
from tailor.compressor.model.lazy import LazyDecoder
from tailor.compressor.puzzle import gkd, parallel
from tailor.compressor.puzzle.plan import Distillation


def models(folder: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    """A random Llama parent and the same model with its weights perturbed (the child GKD trains)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder / "parent")
    child = load_decoder(folder / "parent")
    with torch.no_grad():
        for param in child.parameters():
            param.add_(0.02 * torch.randn_like(param))
    write_checkpoint(child, folder / "child", read_config(folder / "parent"), folder / "parent")
    return folder / "parent", folder / "child"


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {name: tensor.float() for file in sorted(folder.glob("*.safetensors")) for name, tensor in
            load_file(file).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4, help="sequences a step (all on the one rank)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    parallel.init(device)
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        parent, child = models(Path(scratch), args.hidden, args.layers)
        teacher = LazyDecoder(parent, torch.bfloat16, device)
        train = torch.randint(0, 32000, (4 * args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))
        for offload in (False, True):
            budget = Distillation(tokens=args.steps * args.batch * args.seq_len, lr=1e-4, batch=args.batch,
                                  micro_batch=1, recompute=True, offload=offload)
            if on_gpu:
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            out = Path(scratch) / f"offload-{offload}" / "child"
            losses = gkd.distill(child, out, teacher, parent, train, budget, 7, print, None, checkpoint_seconds=0)
            runs[offload] = {"losses": losses, "seconds_per_step": (time.perf_counter() - started) / len(losses),
                             "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else 0.0,
                             "weights": weights(out)}
        apart = max(float((runs[True]["weights"][name] - tensor).abs().max())
                    for name, tensor in runs[False]["weights"].items())
    result = {"device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "torch": torch.__version__,
              **{k: v for k, v in vars(args).items() if k != "out"}, "largest_weight_difference": apart,
              "largest_loss_difference": max(abs(a - b) for a, b in zip(runs[False]["losses"], runs[True]["losses"],
                                                                       strict=True)),
              **{("offloaded" if offload else "on_gpu"): {k: v for k, v in run.items() if k != "weights"}
                 for offload, run in runs.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name in ("on_gpu", "offloaded"):
        run = result[name]
        print(f"{name:>9}: loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}, {run['seconds_per_step']:.2f} s "
              f"a step, peak {run['peak_gpu_gib']:.2f} GiB")
    print(f"largest loss difference {result['largest_loss_difference']:.2e}, largest weight difference {apart:.2e}")
    parallel.finish()


if __name__ == "__main__":
    main()
