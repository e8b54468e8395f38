"""Log-probs and entropy read off vocabulary-sharded logits
(:func:`rltune.models.vocab_parallel.vocab_parallel_token_stats`) equal those of the whole
vocabulary, with their gradients, in a real process group (gloo, CPU).

Tolerance: each shard's ``sum exp`` is a partial sum of the whole one, added across ranks
in another order: fp32 rounding ~1e-7 relative on values of magnitude <= ~10 (log-probs
of a 260-token vocabulary with logits of scale 3), so ATOL = 1e-5 (measured ~1e-6).
A shard that skipped the all-reduce of its ``sum exp`` would be off by ``log`` of the
other shards' share, ~1 here; the test of that break is below.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rltune.learner.launch import spawn_learner_group
from rltune.models import vocab_parallel as tp

ATOL = 1e-5
VOCAB = 260


def logits_and_targets() -> tuple[torch.Tensor, torch.Tensor]:
    """``[3, 7, V]`` logits (one row shifted by 1e4: the max-shift must keep exp finite)
    and targets that fall in every shard."""
    g = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(3, 7, VOCAB, generator=g)
    logits[1] += 1e4
    targets = torch.randint(0, VOCAB, (3, 7), generator=g)
    targets[0, :4] = torch.tensor([0, VOCAB // 4, VOCAB // 2 + 1, VOCAB - 1])
    return logits, targets


def reference() -> dict:
    logits, targets = logits_and_targets()
    logits.requires_grad_(True)
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    (picked * weights(picked) + entropy * weights(entropy).flip(-1)).sum().backward()
    return {"logprobs": picked.detach(), "entropy": entropy.detach(), "grad": logits.grad}


def weights(x: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-1.0, 2.0, x.numel()).reshape(x.shape)


def sharded() -> dict:
    """In each rank: its slice of the vocabulary, the stats, the gradient of its slice;
    then (``broken``) the log-probs again without the all-reduce of the partial sums,
    the mistake the comparison must catch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, targets = logits_and_targets()
    width = VOCAB // world
    local = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    picked, entropy = tp.vocab_parallel_token_stats(local, targets, dist.group.WORLD, rank * width,
                                                    with_entropy=True)
    (picked * weights(picked) + entropy * weights(entropy).flip(-1)).sum().backward()
    tp._SumOverGroup.forward = staticmethod(lambda ctx, x, group: x.clone())
    broken, _ = tp.vocab_parallel_token_stats(local.detach(), targets, dist.group.WORLD, rank * width)
    return {"logprobs": picked.detach(), "entropy": entropy.detach(), "grad": local.grad, "broken": broken}


def check(world: int) -> None:
    want = reference()
    for rank, got in enumerate(spawn_learner_group(world, sharded, backend="gloo")):
        width = VOCAB // world
        torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=ATOL, rtol=0)
        torch.testing.assert_close(got["entropy"], want["entropy"], atol=ATOL, rtol=0)
        torch.testing.assert_close(got["grad"], want["grad"][..., rank * width:(rank + 1) * width],
                                   atol=ATOL, rtol=0)
        # the comparison can fail: without the all-reduce of the partial sums a rank's
        # log-probs are those of its own slice of the vocabulary
        assert (got["broken"] - want["logprobs"]).abs().max() > 0.1


def test_matches_whole_vocabulary_over_two_ranks() -> None:
    check(2)


@pytest.mark.slow
def test_matches_whole_vocabulary_over_four_ranks() -> None:
    check(4)


def test_plain_logits_are_not_sharded() -> None:
    assert tp.vocab_shard(torch.zeros(2, 3, 5)) is None
