"""A learner scores preference pairs as a model in this process does
(``rltune/learner/pair_scoring.py``): the runtime computes DPO's reference log-probs and
the held-out metrics through ``learner_pair_outputs``, on a Ray group's ranks as in one
process, so these pin the rank's side against :class:`ModelScorer`.

Tolerance 1e-5 on log-probs (|log p| < 10 here): the learner cuts a batch into chunks of
its micro-batch budget, so a row goes through fp32 products over other row counts than
in the one-batch forward, which may round differently by a few ulps per product."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
import torch

from rltune.config.schema import AlgoConfig, LoraConfig, TrainConfig
from rltune.data.collate import collate_pairs
from rltune.data.records import Prompt
from rltune.learner.learner import LocalLearner
from rltune.learner.pair_scoring import (
    ModelScorer,
    group_fingerprint,
    learner_pair_outputs,
    learner_weights_fingerprint,
    pair_seq_logps,
    reference_seq_logps,
    scorer_forward,
    weights_fingerprint,
)
from rltune.learner.preference import preference_method
from rltune.models.lora import apply_lora
from rltune.models.reward_model import load_reward_model
from rltune.runtime.local import LocalTrained

ATOL = 1e-5


def make_pairs(n: int = 6) -> list[Prompt]:
    g = torch.Generator().manual_seed(3)
    tokens = lambda k: torch.randint(4, 260, (k,), generator=g).tolist()
    return [Prompt(id=f"p{i}", text="unused", input_ids=tokens(2 + i),
                   meta={"chosen_ids": tokens(1 + i) + [3], "rejected_ids": tokens(6 - i) + [3]}) for i in range(n)]


def learner_of(model: torch.nn.Module, method: str, budget: int = 40, precision: str = "fp32") -> LocalLearner:
    """A learner whose micro-batch budget cuts the six pairs' batch into several chunks."""
    objective = preference_method(method).objective(AlgoConfig(name=method))
    return LocalLearner(model, objective, TrainConfig(micro_batch_tokens=budget, precision=precision))


def test_a_learner_scores_log_probs_and_the_reference_as_the_model_does(tiny_model) -> None:
    pairs = make_pairs()
    batch = collate_pairs(pairs, 0)
    learner = learner_of(copy.deepcopy(tiny_model), "dpo")
    got = learner_pair_outputs(learner, batch, "logprobs", False)
    assert got.shape == batch.loss_mask.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, ModelScorer(tiny_model).pair_outputs(batch, "logprobs"), rtol=0, atol=ATOL)
    assert float((got * batch.loss_mask).abs().sum()) > 1.0  # not all zeros
    reference = pair_seq_logps(scorer_forward(LocalTrained(learner), "logprobs", adapters_off=True), pairs, 0,
                               budget=40)
    # a sum of at most 7 completion tokens' log-probs (6 drawn + EOS), each within ATOL
    torch.testing.assert_close(reference, reference_seq_logps(tiny_model, pairs, 0, budget=10_000), rtol=0,
                               atol=ATOL * 7)


def test_adapters_off_scores_the_frozen_base_of_a_lora_learner(tiny_model) -> None:
    model = apply_lora(copy.deepcopy(tiny_model), LoraConfig(r=4))
    with torch.no_grad():  # adapters that have trained: B away from its zero start
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    batch = collate_pairs(make_pairs(), 0)
    learner = learner_of(model, "dpo")
    base = ModelScorer(tiny_model).pair_outputs(batch, "logprobs")
    torch.testing.assert_close(learner_pair_outputs(learner, batch, "logprobs", True), base, rtol=0, atol=ATOL)
    adapted = learner_pair_outputs(learner, batch, "logprobs", False)
    assert float((adapted - base).abs().max()) > 0.01
    torch.testing.assert_close(adapted, ModelScorer(model).pair_outputs(batch, "logprobs"), rtol=0, atol=ATOL)


def test_a_reward_model_learner_scores_each_row(tiny_path: str) -> None:
    rm = load_reward_model(tiny_path, seed=0)
    batch = collate_pairs(make_pairs(), 0)
    got = learner_pair_outputs(learner_of(copy.deepcopy(rm), "reward_model"), batch, "scores", False)
    assert got.shape == (len(batch),)
    torch.testing.assert_close(got, ModelScorer(rm).pair_outputs(batch, "scores"), rtol=0, atol=ATOL)


@pytest.mark.parametrize("prints", [["a"], ["a", "a", "a"]])
def test_ranks_with_the_same_weights_fingerprint_as_one(prints: list[str]) -> None:
    assert group_fingerprint(prints) == "a"


def test_sharded_ranks_fingerprint_their_shards_in_rank_order() -> None:
    assert group_fingerprint(["a", "b"]) == hashlib.sha256(json.dumps(["a", "b"]).encode()).hexdigest()
    assert group_fingerprint(["a", "b"]) != group_fingerprint(["b", "a"])


def test_a_learners_fingerprint_names_its_precision_unless_fp32(tiny_model) -> None:
    """The reference is scored under the learner's autocast, so a bf16 learner's cache is
    not an fp32 one's (nor a ModelScorer's, which computes in the weights' dtype); fp32's
    stays the weights' own, as the caches written before say."""
    plain = weights_fingerprint(tiny_model)
    assert learner_weights_fingerprint(learner_of(copy.deepcopy(tiny_model), "dpo")) == plain
    bf16 = learner_weights_fingerprint(learner_of(copy.deepcopy(tiny_model), "dpo", precision="bf16"))
    assert bf16 != plain and bf16.startswith(plain)
