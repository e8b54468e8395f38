"""Routing replay and aux-free balancing in a learner group: two ranks, each on its shard
of a batch with recorded routes, take the step one process takes on the whole batch (the
same router agreement, the same bias update, the same weights)."""

from __future__ import annotations

import copy

import pytest
import torch
from replay_workers import group_replay, one_step, replay_model

from rltune.data.collate import collate_rollouts
from rltune.data.records import Prompt, SamplingParams
from rltune.learner.launch import spawn_learner_group
from rltune.models.load import load_model, load_tokenizer, resolve_model
from rltune.models.routing import install_routing
from rltune.rollout.hf import HFGenerator


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_model("builtin:tiny-moe", cache_dir=str(tmp_path_factory.mktemp("builtin-moe")))


@pytest.fixture(scope="module")
def batch(model_dir: str):
    """8 samples generated (routes recorded) by the unperturbed model, with advantages
    and the generator's log-probs as the reference's."""
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    install_routing(model)
    texts = ["1 + 2 =", "the cat sat", "7 * 8 - 3 =", "hello"]
    prompts = [Prompt(id=str(i), text=t, input_ids=tok(t)["input_ids"]) for i, t in enumerate(texts)]
    rollouts = HFGenerator(model, tok, rng=torch.Generator().manual_seed(0)).generate(
        prompts, SamplingParams(n=2, max_new_tokens=8))
    batch = collate_rollouts(rollouts, tok.pad_token_id)
    batch.ref_logprobs = batch.behaviour_logprobs  # the tests' objective has a KL term
    batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(2))[:, None].expand_as(
        batch.loss_mask)
    return batch


@pytest.mark.slow  # ~45 s here: two spawned ranks, DDP and FSDP2; the fast representative of the
# bias update is tests/unit/models/test_routing.py::test_the_learner_step_updates_the_bias...
def test_two_ranks_replay_and_balance_as_one_process(model_dir: str, batch) -> None:
    """Agreement counts and the expert load are integer sums over the ranks: equal
    exactly, so the biases (one +-rate step from the group's load) are equal to the bit.
    Weights: fp32 gradients summed in another order, then one Adam step at lr 1e-3 with
    eps 1e-3 (slope <= 1): 1e-6 as in the learner-group tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = one_step(replay_model(model_dir), copy.deepcopy(batch))
    finally:
        torch.set_num_threads(threads)
    assert single["metrics"]["moe/router_agreement"] < 1.0  # the perturbed router disagrees
    group = spawn_learner_group(2, group_replay, model_dir, batch, backend="gloo", timeout_s=240)
    for strategy in ("ddp", "fsdp2"):
        for rank in group:
            got = rank[strategy]
            assert got["metrics"]["moe/router_agreement"] == single["metrics"]["moe/router_agreement"]
            assert got["metrics"]["moe/load_max"] == single["metrics"]["moe/load_max"]
            assert torch.equal(got["bias"], single["bias"]), strategy
            for name, value in single["weights"].items():
                torch.testing.assert_close(got["weights"][name], value, atol=1e-6, rtol=0, msg=name)
