"""Replace-one-block scores: the KL of a variant's model to the parent's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tailor.compressor.puzzle.scoring import kl_and_loss

VOCAB = 512


def test_the_kl_is_the_parents_to_the_variants_and_never_negative() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16, VOCAB, generator=generator) * 3
    ids = torch.randint(0, VOCAB, (4, 16), generator=generator)
    reference = F.log_softmax(logits, -1)
    other = logits + torch.randn(logits.shape, generator=generator)
    kl, loss = kl_and_loss(reference, other, ids)
    expected = F.kl_div(F.log_softmax(other[:, :-1], -1), reference[:, :-1], log_target=True, reduction="none")
    torch.testing.assert_close(torch.tensor(kl), expected.sum(-1).mean())
    torch.testing.assert_close(torch.tensor(loss), F.cross_entropy(other[:, :-1].reshape(-1, VOCAB),
                                                                   ids[:, 1:].reshape(-1)))
    # variants a hair away from the parent: float32 round-off alone takes some positions' sums below 0
    nearly = [kl_and_loss(reference, logits + 1e-4 * torch.randn(logits.shape, generator=generator), ids)[0]
              for _ in range(20)]
    assert all(0 <= value < 1e-6 for value in nearly)
