"""The workload of a config: algorithm traits from the registry, batch and lengths from
the config's sections."""

from __future__ import annotations

import pytest

from rltune.config import Config
from rltune.plan.errors import PlanError
from rltune.plan.spec import Workload
from rltune.plan.workload import rollout_precision, workload_from_config

REWARD = [{"fn": "builtin:exact_numeric"}]


def config(**sections) -> Config:
    return Config.model_validate(sections)


def test_grpo_generates_groups_without_critic_or_reference():
    cfg = config(
        algo={"name": "grpo", "group_size": 16, "importance_correction": "token-truncate"},
        train={"prompts_per_step": 32, "precision": "bf16", "logprob_chunk_tokens": 256},
        data={"max_prompt_tokens": 1024},
        rollout={"max_new_tokens": 4096},
        model={"dtype": "bfloat16", "lora": {"r": 16}},
        runtime={"max_staleness": 1},
        reward=REWARD,
    )
    work = workload_from_config(cfg)
    assert work == Workload(
        algo="grpo", generates=True, critic=False, reference=False, prompts_per_step=32,
        group_size=16, prompt_tokens=1024, completion_tokens=4096, precision="bf16",
        rollout_precision="bf16", lora_rank=16, model_dtype="bfloat16", logprob_chunk_tokens=256,
        epochs=1, minibatches=1, max_staleness=1,
    )
    # 32 prompts x 16 samples = 512 rows of 1,024 + 4,096 = 5,120 tokens
    assert (work.samples_per_step, work.tokens_per_sample) == (512, 5120)


def test_grpo_with_a_kl_term_loads_the_reference():
    work = workload_from_config(config(algo={"name": "grpo", "kl_coef": 0.01}, reward=REWARD))
    assert work.reference and not work.critic


def test_ppo_trains_a_critic_over_epochs_and_minibatches():
    cfg = config(algo={"name": "ppo", "group_size": 4, "epochs": 2, "minibatches": 4},
                 train={"prompts_per_step": 8}, reward=REWARD)
    work = workload_from_config(cfg, prompt_tokens=200)
    assert (work.generates, work.critic, work.reference) == (True, True, False)
    # the runtime draws algo.group_size samples for every online algorithm, PPO included
    assert (work.group_size, work.samples_per_step, work.prompt_tokens) == (4, 32, 200)
    assert (work.epochs, work.minibatches) == (2, 4)


def test_dpo_learns_pairs_against_a_reference_without_generating():
    cfg = config(algo={"name": "dpo", "group_size": 8}, train={"prompts_per_step": 10},
                 rollout={"max_new_tokens": 300}, data={"max_prompt_tokens": 100})
    work = workload_from_config(cfg)
    assert (work.generates, work.critic, work.reference) == (False, False, True)
    # a pair is two rows (chosen, rejected), whatever algo.group_size says: 10 x 2 = 20
    assert (work.group_size, work.samples_per_step) == (2, 20)
    assert (work.prompt_tokens, work.completion_tokens) == (100, 300)
    assert workload_from_config(cfg, completion_tokens=50).completion_tokens == 50


def test_sft_and_simpo():
    sft = workload_from_config(config(algo={"name": "sft", "group_size": 8}))
    assert (sft.generates, sft.reference, sft.group_size) == (False, False, 1)
    simpo = workload_from_config(config(algo={"name": "simpo"}))
    assert (simpo.reference, simpo.group_size) == (False, 2)


@pytest.mark.parametrize(("train", "rollout", "expected"), [
    ("fp32", "auto", "fp32"), ("bf16", "auto", "bf16"), ("fp8", "auto", "bf16"),
    ("fp16", "auto", "fp16"), ("bf16", "fp32", "fp32"),
])
def test_rollout_precision(train, rollout, expected):
    assert rollout_precision(train, rollout) == expected
    cfg = config(train={"precision": train}, rollout={"precision": rollout}, reward=REWARD)
    assert workload_from_config(cfg).rollout_precision == expected


def test_unknown_algorithm_lists_the_registered_ones():
    with pytest.raises(PlanError, match=r"algo.name 'grpoo' is not a registered algorithm; "
                                        r"choose one of .*dpo, .*grpo"):
        workload_from_config(config(algo={"name": "grpoo"}, reward=REWARD))


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_lengths(bad):
    with pytest.raises(PlanError, match=rf"prompt_tokens is {bad}; it must be an integer >= 1"):
        workload_from_config(config(reward=REWARD), prompt_tokens=bad)

