"""GKD's resumable checkpoints: a run killed after a checkpoint resumes and trains the child an uninterrupted run
trains; a checkpoint of another run is not used."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tailor.compressor.model.checkpoint import load_decoder, read_config, write_checkpoint
from tailor.compressor.model.lazy import LazyDecoder
from tailor.compressor.puzzle import gkd, parallel
from tailor.compressor.puzzle.plan import Distillation
from tailor.compressor.puzzle.resume import Checkpoints


class Killed(Exception):
    """Stands for the job being killed right after a checkpoint was saved."""


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    parallel.init(torch.device("cpu"))
    yield
    parallel.finish()


@pytest.fixture
def assembled(tiny_parent: Path, tmp_path: Path) -> Path:
    """The parent with its weights perturbed: a child GKD has something to teach."""
    model = load_decoder(tiny_parent)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    write_checkpoint(model, tmp_path / "assembled", read_config(tiny_parent), tiny_parent)
    return tmp_path / "assembled"


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for file in sorted(folder.glob("*.safetensors")) for name, tensor in load_file(file).items()}


@pytest.mark.parametrize("budget_bytes", [None, 3e5], ids=["sharded-teacher", "streamed-teacher"])
def test_a_killed_gkd_resumes_from_its_checkpoint(tiny_parent: Path, assembled: Path, tmp_path: Path,
                                                  budget_bytes: float | None) -> None:
    parent = LazyDecoder(tiny_parent)
    train = torch.randint(0, parent.arch.vocab_size, (12, 32), generator=torch.Generator().manual_seed(0))
    budget = Distillation(tokens=6 * 2 * 32, lr=1e-3, batch=2)  # 6 steps
    lines: list[str] = []

    def run(out: Path, every: float, progress: object = lines.append) -> list[float]:
        return gkd.distill(assembled, out, parent, tiny_parent, train, budget, 7, progress,  # type: ignore[arg-type]
                           budget_bytes, every)

    whole = run(tmp_path / "whole" / "child", 1e9)

    def killed_after_step_3(line: str) -> None:
        lines.append(line)
        if line.startswith("gkd: checkpoint after step 3/"):
            raise Killed

    out = tmp_path / "resumed" / "child"
    with pytest.raises(Killed):
        run(out, 0, killed_after_step_3)
    checkpoint = out.with_name(gkd.CHECKPOINT_FOLDER)
    assert (checkpoint / "progress.json").exists() and not out.exists()
    assert not list(out.parent.glob("*.partial"))
    # killed between a save's two renames: the previous checkpoint, set aside, is the one to resume from
    checkpoint.rename(checkpoint.with_name(checkpoint.name + ".previous"))
    resumed = run(out, 1e9)
    assert any(line.startswith("gkd: resumed after step 3/6") for line in lines)
    Checkpoints.clear(checkpoint)  # what the pipeline does once the round is recorded
    assert not list(out.parent.glob(f"{gkd.CHECKPOINT_FOLDER}*"))
    assert len(resumed) == len(whole) == 6
    first, second = weights(tmp_path / "whole" / "child"), weights(out)
    if budget_bytes is None:  # the same computation: the same child, to the bit
        assert resumed == whole
        assert all(torch.equal(first[name], second[name]) for name in first)
    else:  # the teacher's states are recomputed over other row groupings: the same child up to rounding
        assert resumed == pytest.approx(whole, rel=1e-4)
        assert all(torch.allclose(first[name].float(), second[name].float(), atol=1e-2) for name in first)
    changed = [name for name in first if not torch.equal(first[name], weights(assembled)[name])]
    assert changed  # GKD trained something


def test_a_checkpoint_of_another_run_is_not_used(tiny_parent: Path, assembled: Path, tmp_path: Path) -> None:
    parent = LazyDecoder(tiny_parent)
    train = torch.randint(0, parent.arch.vocab_size, (12, 32), generator=torch.Generator().manual_seed(0))
    budget = Distillation(tokens=4 * 2 * 32, lr=1e-3, batch=2)
    out = tmp_path / "child"
    lines: list[str] = []

    def killed(line: str) -> None:
        if line.startswith("gkd: checkpoint after step 2/"):
            raise Killed

    with pytest.raises(Killed):
        gkd.distill(assembled, out, parent, tiny_parent, train, budget, 7, killed, None, 0)
    gkd.distill(assembled, out, parent, tiny_parent, train, budget, 8, lines.append, None, 1e9)  # another seed
    assert any("is of another run (changed: seed); starting over" in line for line in lines)
    assert not any("resumed" in line for line in lines)


def test_micro_batches_recomputed_layers_and_a_chunked_kl_train_the_same_child(
        tiny_parent: Path, assembled: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a 4,096-token, 131K-vocabulary step needs to fit (one row at a time, each layer's activations recomputed
    in backward, the KL over chunks of tokens) is the same training: the same losses and child up to rounding."""
    parent = LazyDecoder(tiny_parent)
    train = torch.randint(0, parent.arch.vocab_size, (12, 32), generator=torch.Generator().manual_seed(0))
    plain = gkd.distill(assembled, tmp_path / "plain" / "child", parent, tiny_parent, train,
                        Distillation(tokens=4 * 4 * 32, lr=1e-3, batch=4), 7, lambda _: None, None, 1e9)
    monkeypatch.setattr(gkd, "KL_TOKENS", 24)  # a row of 32 tokens in two chunks
    frugal = gkd.distill(assembled, tmp_path / "frugal" / "child", parent, tiny_parent, train,
                         Distillation(tokens=4 * 4 * 32, lr=1e-3, batch=4, micro_batch=1, recompute=True), 7,
                         lambda _: None, None, 1e9)
    assert frugal == pytest.approx(plain, rel=1e-3)  # BF16 autocast rounds other batch shapes otherwise
    first, second = weights(tmp_path / "plain" / "child"), weights(tmp_path / "frugal" / "child")
    assert all(torch.allclose(first[name].float(), second[name].float(), atol=1e-2) for name in first)


def test_recomputed_layers_and_a_chunked_kl_save_a_fraction_for_backward(
        tiny_parent: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes autograd saves for backward in one GKD loss, counted with saved-tensor hooks: with `recompute` and the
    KL in chunks, the layers' inputs and their outputs for the cosine loss, not every layer's activations and
    the whole [rows, seq, vocab] logits."""
    from tailor.compressor.model.modeling import Decoder

    model = LazyDecoder(tiny_parent).load().train()
    ids = torch.randint(0, model.arch.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states: list[torch.Tensor] = []
        logits = model(ids, states=states)

    alive = {tensor.untyped_storage().data_ptr() for tensor in [logits, *states, *model.parameters()]}

    def saved(child: Decoder, recompute: bool) -> int:
        """Bytes of the storages saved for backward that the loss made (not its inputs, not the weights)."""
        sizes: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in alive:
                sizes[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            gkd.gkd_loss(child, ids, states, logits, 1.0, recompute)
        return sum(sizes.values())

    everything = saved(model, False)
    monkeypatch.setattr(gkd, "KL_TOKENS", 16)
    frugal = saved(model, True)
    assert frugal < everything / 4, (frugal, everything)


def test_an_offloaded_child_trains_the_child_a_device_held_one_trains(tiny_parent: Path, assembled: Path,
                                                                      tmp_path: Path) -> None:
    """`gkd.offload` keeps the child's shards in host memory. Here the device is the host, so the same numbers
    must come out, to the bit, through FSDP2's offload policy, the clipping and the gathering that run it."""
    parent = LazyDecoder(tiny_parent)
    train = torch.randint(0, parent.arch.vocab_size, (12, 32), generator=torch.Generator().manual_seed(0))
    children = {}
    for offload in (False, True):
        out = tmp_path / f"offload-{offload}" / "child"
        losses = gkd.distill(assembled, out, parent, tiny_parent, train,
                             Distillation(tokens=4 * 2 * 32, lr=1e-3, batch=2, offload=offload), 7, lambda _: None,
                             None, 1e9)
        children[offload] = (losses, weights(out))
    assert children[True][0] == children[False][0]
    assert all(torch.equal(tensor, children[False][1][name]) for name, tensor in children[True][1].items())


def test_clipping_sharded_gradients_scales_them_to_the_bound(tiny_parent: Path) -> None:
    """The norm is summed over the shards on the device: the gradients come out scaled by max_norm over their
    norm, as float64 arithmetic on the whole gradients has it."""
    model = gkd.sharded_model(tiny_parent, torch.device("cpu"))
    ids = torch.randint(0, model.arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, states=[]).square().mean().backward()  # the path that calls each sharded layer
    before = [param.grad.full_tensor().double() for param in model.parameters()]
    norm = float(torch.sqrt(sum(grad.square().sum() for grad in before)))
    gkd.clip_gradients(model, 1e-3, torch.device("cpu"))
    assert norm > 1e-3  # so the bound applies
    for param, grad in zip(model.parameters(), before, strict=True):
        assert torch.allclose(param.grad.full_tensor().double(), grad * 1e-3 / (norm + 1e-6), rtol=1e-5, atol=0)
