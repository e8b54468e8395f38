"""Mini-batches of ``learn``: a preference method's (chosen, rejected) pairs are shuffled and
split whole, each in its order; more mini-batches than pairs are refused; other algorithms'
rows are shuffled by exactly the draw they always had (exact resumes depend on it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rltune.algos import ALGORITHMS
from rltune.config import ConfigError
from rltune.data.collate import collate_pairs, collate_sft
from rltune.data.records import Prompt, TrainBatch
from rltune.runtime.loop import learn, minibatch_rows


class _Recorder:
    """A learner that keeps the input ids of each mini-batch it steps on."""

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []

    def step(self, mb: TrainBatch) -> dict[str, float]:
        self.batches.append(mb.input_ids.tolist())
        return {"loss": 0.0}


def _run(algo: str, *, minibatches: int, epochs: int = 1, seed: int = 0) -> SimpleNamespace:
    """What ``learn`` reads of a run: the algo settings, the algorithm, the roles, the
    progress (a config check may refuse these settings before a run gets here)."""
    return SimpleNamespace(
        cfg=SimpleNamespace(algo=SimpleNamespace(minibatches=minibatches, epochs=epochs, critic_warmup_steps=0)),
        spec=SimpleNamespace(algorithm=ALGORITHMS[algo]),
        roles=SimpleNamespace(critic=None, learner=_Recorder()),
        progress=SimpleNamespace(step=1, minibatch_rng=torch.Generator().manual_seed(seed)),
    )


def _pair_batch(n: int) -> TrainBatch:
    """``n`` pairs: prompt k is token 10 + k, its chosen response 100 + k, rejected 200 + k."""
    return collate_pairs([Prompt(id=f"p{k}", text="", input_ids=[10 + k],
                                 meta={"chosen_ids": [100 + k], "rejected_ids": [200 + k]})
                          for k in range(n)], pad_id=0)


@pytest.mark.parametrize("algo", ["dpo", "simpo", "reward_model"])
@pytest.mark.parametrize(("pairs", "minibatches", "epochs"), [(8, 2, 2), (8, 3, 1), (5, 5, 1), (4, 4, 3)])
def test_preference_minibatches_hold_whole_pairs_in_order(algo, pairs, minibatches, epochs) -> None:
    run = _run(algo, minibatches=minibatches, epochs=epochs)
    learn(run, _pair_batch(pairs))
    seen = []
    for rows in run.roles.learner.batches:
        assert len(rows) % 2 == 0, rows
        for chosen, rejected in zip(rows[0::2], rows[1::2]):
            k = chosen[0] - 10
            assert (chosen, rejected) == ([10 + k, 100 + k], [10 + k, 200 + k]), rows
            seen.append(k)
    # every pair once per epoch, and the pairs are shuffled
    assert sorted(seen) == sorted(list(range(pairs)) * epochs)
    assert seen != sorted(seen)


def test_more_minibatches_than_pairs_are_refused() -> None:
    with pytest.raises(ConfigError) as err:
        learn(_run("simpo", minibatches=64), _pair_batch(4))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("algo.minibatches=64 is more than the 4 preference pairs of a step")
    assert "set algo.minibatches to at most 4" in message


@pytest.mark.parametrize(("rows", "minibatches"), [(8, 2), (7, 3), (16, 4), (3, 8)])
def test_single_rows_are_shuffled_by_the_same_draw_as_before(rows, minibatches) -> None:
    got_rng, old_rng = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(3):
        got = minibatch_rows(rows, minibatches, got_rng)
        old = torch.randperm(rows, generator=old_rng).chunk(minibatches)
        assert [t.tolist() for t in got] == [t.tolist() for t in old]
        assert all(t.dtype == torch.long for t in got)
    assert torch.equal(got_rng.get_state(), old_rng.get_state())


def test_one_minibatch_takes_every_row_in_order_and_draws_nothing() -> None:
    rng = torch.Generator().manual_seed(5)
    before = rng.get_state()
    assert [t.tolist() for t in minibatch_rows(6, 1, rng, unit=2)] == [list(range(6))]
    assert torch.equal(rng.get_state(), before)


def test_online_and_sft_minibatches_are_the_old_randperm_split() -> None:
    prompts = [Prompt(id=f"p{k}", text="", input_ids=[10 + k], meta={"completion_ids": [100 + k]})
               for k in range(6)]
    batch = collate_sft(prompts, pad_id=0)
    run = _run("sft", minibatches=3, epochs=2, seed=7)
    learn(run, batch)
    rng = torch.Generator().manual_seed(7)
    old = [rows for _ in range(2) for rows in torch.randperm(len(batch), generator=rng).chunk(3)]
    assert run.roles.learner.batches == [batch.input_ids[rows].tolist() for rows in old]
    assert torch.equal(run.progress.minibatch_rng.get_state(), rng.get_state())
