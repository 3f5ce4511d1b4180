"""Stage 3, replace-1-block scoring: each variant alone in the otherwise unchanged current model.

The score is KL(current || with the variant) of next-token distributions, per token, on held-out
text; the LM loss is recorded too. The residual stream entering every slot and after the last one
were captured once (`activations`). Each rank scores the slots it owns (dealt by their cost: variants
times the slots after them) in sweeps over the layers, one layer resident at a time: a variant's stream
starts at its slot and is carried through the current layers after it, so a sweep reads each layer once
for all its variants. A sweep holds at most `streams` variant streams (the memory budget decides), then
the logits come from the LM head, the variant's and the current model's (from its last stream), HEAD_TOKENS
tokens at a time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel

from tailor.compressor.files import write_json
from tailor.compressor.model.chunks import LAYER_TOKENS
from tailor.compressor.model.lazy import LazyDecoder
from tailor.compressor.model.modeling import residual
from tailor.compressor.model.training import Reporter
from tailor.compressor.puzzle import parallel
from tailor.compressor.puzzle.activations import FINAL, Progress, scoring_file
from tailor.compressor.puzzle.activations import load as load_activations
from tailor.compressor.puzzle.bld import variant_branch
from tailor.compressor.puzzle.footprint import HEAD_TOKENS
from tailor.compressor.puzzle.library import Variant


class Score(BaseModel):
    kl: float  # nats per token, KL(reference || variant)
    lm_loss: float  # nats per token on the held-out text


def kl_and_loss(reference_logprobs: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, float]:
    """Mean KL(reference || model) and LM loss over next-token predictions (positions 0..n-2). A position's KL is
    never negative; float32 round-off can make one of a nearly unchanged model's about -1e-9, which is taken as 0."""
    logprobs = F.log_softmax(logits[:, :-1].float(), -1)
    reference = reference_logprobs[:, :-1].float()
    kl = (reference.exp() * (reference - logprobs)).sum(-1).clamp_min(0).mean()
    loss = F.nll_loss(logprobs.reshape(-1, logprobs.shape[-1]), ids[:, 1:].reshape(-1))
    return float(kl), float(loss)


def scoring_slots(variants: list[list[Variant]], rank: int, world: int) -> list[int]:
    """The slots rank `rank` scores, dealt by cost: a slot's variants times the slots their streams run through."""
    costs = {options[0].slot: len(options) * (len(variants) - options[0].slot) for options in variants if options}
    return parallel.deal(costs, rank, world)


def _chunked(run: object, x: torch.Tensor) -> torch.Tensor:
    """`run` over LAYER_TOKENS tokens of `x` (whole sequences, at least one) at a time."""
    rows = max(1, LAYER_TOKENS // x.shape[1])
    return torch.cat([run(x[i:i + rows]) for i in range(0, x.shape[0], rows)])  # type: ignore[operator]


@torch.no_grad()
def score_variants(model: LazyDecoder, variants: list[list[Variant]], bld: Path, activations: Path, ids: torch.Tensor,
                   known: dict[str, Score], progress: Progress, streams: int) -> dict[str, Score]:
    """Scores keyed "slot:label" of this rank's slots; entries already in `known` are kept, not recomputed."""
    rank, world = parallel.rank_world()
    head = model.head()
    reference = load_activations(activations / FINAL, model.device)  # the current model's last stream
    scores: dict[str, Score] = {}
    owned = set(scoring_slots(variants, rank, world))
    mine = [v for options in variants for v in options if v.slot in owned]
    unchanged = Score(kl=0.0, lm_loss=_score(head, reference, reference, ids).lm_loss)  # the current model's
    for variant in mine:
        key = f"{variant.slot}:{variant.label}"
        if key in known:
            scores[key] = known[key]
        elif variant.is_current:
            scores[key] = unchanged
    todo = [v for v in mine if f"{v.slot}:{v.label}" not in scores]
    started, done = time.monotonic(), 0
    for first in range(0, len(todo), streams):
        group = todo[first:first + streams]
        swept = _sweep_progress(progress, f"scoring: {done}/{len(todo)} variants, {len(group)} streams",
                                len(model.arch.blocks))
        for key, state in _sweep(model, group, bld, activations, swept).items():
            scores[key] = _score(head, reference, state, ids)
            done += 1
        eta = (time.monotonic() - started) / done * (len(todo) - done)
        progress(f"scoring: {done}/{len(todo)} variants, eta {eta:.0f}s")
    return scores


def _score(head: torch.nn.Module, reference: torch.Tensor, state: torch.Tensor, ids: torch.Tensor) -> Score:
    """KL and LM loss of the model whose last residual stream is `state` against the one whose stream is
    `reference`, HEAD_TOKENS tokens (whole sequences, at least one) of logits at a time."""
    kl = loss = 0.0
    rows = max(1, HEAD_TOKENS // ids.shape[1])
    for i in range(0, ids.shape[0], rows):
        reference_logprobs = F.log_softmax(head(reference[i:i + rows]).float(), -1)
        part_kl, part_loss = kl_and_loss(reference_logprobs, head(state[i:i + rows]), ids[i:i + rows])
        taken = ids[i:i + rows].shape[0]
        kl, loss = kl + part_kl * taken, loss + part_loss * taken
    return Score(kl=kl / ids.shape[0], lm_loss=loss / ids.shape[0])


def _sweep_progress(progress: Progress, said: str, layers: int) -> Callable[[int], None]:
    """What a sweep calls after each layer: `said` and the layer, at least every 20 s (`Reporter`), so a sweep of
    many variants shows it is going."""
    reporter = Reporter(layers, layers)

    def swept(layer: int) -> None:
        if reporter.due(layer + 1) and layer + 1 < layers:
            progress(f"{said} at layer {layer + 1}/{layers}")

    return swept


def _sweep(model: LazyDecoder, group: list[Variant], bld: Path, activations: Path,
           swept: Callable[[int], None]) -> dict[str, torch.Tensor]:
    """The residual stream after the last slot with each variant of `group` in its slot, keyed "slot:label";
    `swept(layer)` after each layer."""
    slots = model.slots()
    streams: dict[str, torch.Tensor] = {}
    start = min(v.slot for v in group)
    for layer_index in range(slots[start].layer, len(model.arch.blocks)):
        layer = model.layer(layer_index)
        for slot in (s for s in slots if s.layer == layer_index and s.index >= start):
            current = layer.branch(slot.kind)
            for key in streams:
                streams[key] = _chunked(lambda x, b=current: residual(b, x), streams[key])
            starting = [v for v in group if v.slot == slot.index]
            if starting:
                inputs = load_activations(scoring_file(activations, slot.index), model.device)
                for variant in starting:
                    branch = variant_branch(model, layer, variant, bld)
                    streams[f"{variant.slot}:{variant.label}"] = _chunked(lambda x, b=branch: residual(b, x), inputs)
        del layer
        swept(layer_index)
    return streams


def gather_scores(path: Path, mine: dict[str, Score], known: dict[str, Score]) -> dict[str, Score]:
    """Every rank's scores, merged into `path` by rank 0 (each rank writes its own file first) unless they are
    the `known` ones already there."""
    rank, world = parallel.rank_world()
    part = path.with_name(f"{path.stem}.rank{rank}.json")
    write_scores(part, mine)
    parallel.barrier()
    merged: dict[str, Score] = {}
    for r in range(world):
        other = path.with_name(f"{path.stem}.rank{r}.json")
        merged.update({k: Score.model_validate(v) for k, v in json.loads(other.read_text()).items()})
    parallel.barrier()
    if rank == 0:
        if merged.keys() != known.keys():
            write_scores(path, merged)
        for r in range(world):
            path.with_name(f"{path.stem}.rank{r}.json").unlink()
    return merged


def write_scores(path: Path, scores: dict[str, Score]) -> None:
    write_json(path, {k: v.model_dump() for k, v in sorted(scores.items(), key=lambda kv: _order(kv[0]))})


def _order(key: str) -> tuple[int, str]:
    slot, label = key.split(":", 1)
    return int(slot), label
