"""The algorithm registry and the import rule of rltune.algos."""

import ast
import dataclasses
import pathlib

import pytest

import rltune.algos as algos
from rltune.algos import ALGORITHMS, Algorithm, config_problems, group_advantages, ppo_policy_loss, sft_loss
from rltune.config.schema import AlgoConfig


def test_every_algorithm_is_registered_under_its_name():
    from rltune.config.schema import ALGO_PRESETS

    for key, algo in ALGORITHMS.items():
        assert algo.name == key
    assert set(ALGO_PRESETS) <= set(ALGORITHMS)
    assert AlgoConfig.model_fields["name"].default in ALGORITHMS


def test_what_each_algorithm_is_as_the_papers_say():
    def having(trait: str) -> set[str]:
        return {k for k, a in ALGORITHMS.items() if getattr(a, trait)}

    assert having("online") == {"grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"}
    assert having("group_baseline") == having("online") - {"ppo", "reinforce_pp"}
    assert having("token_rewards") == {"ppo", "reinforce_pp", "reinforce_pp_baseline"}
    assert having("sequence_ratio") == {"gspo"}
    assert having("pairs") == {"dpo", "simpo", "reward_model"}


def problems(*overrides: str) -> list[str]:
    from rltune.config import load_config

    cfg = load_config(None, list(overrides))
    return config_problems(ALGORITHMS[cfg.algo.name], cfg)


REWARD = "reward=[{fn: builtin:exact_numeric}]"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["algo.name=grpo"], "algo.name=grpo needs at least one entry in `reward` (or an `env` whose steps give rewards)"),
        (["algo.name=rloo", "algo.group_size=1", REWARD], "algo.group_size must be >= 2 for rloo (the group is the baseline)"),
        (["algo.name=sft", "runtime.max_staleness=1", "algo.importance_correction=token-truncate"],
         ["runtime.max_staleness is for algorithms that generate; sft does not",
          "algo.importance_correction=token-truncate does not apply to algo.name=sft "
          "(it learns from a fixed dataset and does not generate); remove it"]),
        (["algo.name=grpo", "algo.kl_coef=0.1", "algo.kl_in_reward=true", REWARD],
         "algo.kl_in_reward needs per-token rewards (ppo, reinforce_pp, reinforce_pp_baseline); "
         "for grpo put the KL in the loss (kl_in_reward: false)"),
        (["algo.name=gspo", "algo.dual_clip=3", REWARD],
         "algo.dual_clip applies to token ratios; gspo clips one ratio per sequence"),
        (["algo.name=gspo", "algo.aggregation=token-mean", REWARD],
         "algo.name=gspo averages one ratio per sequence; algo.aggregation must be seq-mean-token-mean, not token-mean"),
    ],
)
def test_the_registry_names_what_its_algorithm_cannot_run_with(overrides, expected):
    assert problems(*overrides) == (expected if isinstance(expected, list) else [expected])


def test_what_an_algorithm_can_run_with_has_no_problem():
    assert problems("algo.name=ppo", "algo.group_size=1", "algo.kl_coef=0.1", "algo.kl_in_reward=true", REWARD) == []
    assert problems("algo.name=gspo", REWARD) == []  # its preset's aggregation
    assert problems("algo.name=dpo") == []  # offline: no reward, no group
    assert problems("algo.name=sft", "algo.group_size=8") == []  # a key set to its default is not reported
    assert problems("algo.name=grpo", "env.name=builtin:tools") == []  # the environment's rewards


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["algo.name=sft", "algo.kl_coef=0.1"],
         "algo.kl_coef=0.1 does not apply to algo.name=sft (it learns from a fixed dataset and does not generate); remove it"),
        (["algo.name=dpo", "algo.group_size=4"],
         "algo.group_size=4 does not apply to algo.name=dpo (it learns from a fixed dataset and does not generate); remove it"),
        (["algo.name=grpo", "model.critic_path=/m", REWARD],
         "model.critic_path does not apply to algo.name=grpo (it has no critic); remove it"),
        (["algo.name=grpo", "algo.lam=0.9", REWARD], "algo.lam=0.9 does not apply to algo.name=grpo (it has no critic (GAE)); remove it"),
        (["algo.name=rloo", "algo.adv_scale=none", REWARD],
         "algo.adv_scale=none does not apply to algo.name=rloo (its advantages are not GRPO's); remove it"),
        (["algo.name=grpo", "algo.gamma=0.9", REWARD],
         "algo.gamma=0.9 does not apply to algo.name=grpo (it has no per-token returns); remove it"),
        (["algo.name=ppo", "algo.kl_horizon=100", REWARD],
         "algo.kl_horizon=100 does not apply to algo.name=ppo (it adapts the KL in the reward (kl_in_reward: true)); remove it"),
        (["algo.name=ppo", "algo.kl_coef=0.1", "algo.kl_in_reward=true", "algo.kl_kind=k2", REWARD],
         "algo.kl_kind=k2 does not apply to algo.name=ppo (the KL in the reward is k1); remove it"),
        (["algo.name=grpo", "algo.max_refill_rounds=2", REWARD],
         "algo.max_refill_rounds=2 does not apply to algo.name=grpo (dynamic_sampling is off); remove it"),
        (["algo.name=grpo", "algo.overlong_penalty=0.5", REWARD],
         "algo.overlong_penalty=0.5 does not apply to algo.name=grpo (overlong_buffer is 0); remove it"),
        (["algo.name=grpo", "algo.importance_cap=3", REWARD],
         "algo.importance_cap=3.0 does not apply to algo.name=grpo (importance_correction is none); remove it"),
        (["algo.name=grpo", "algo.beta=0.5", REWARD],
         "algo.beta=0.5 does not apply to algo.name=grpo (it does not learn from preference pairs); remove it"),
        (["algo.name=simpo", "algo.dpo_kind=ipo"],
         "algo.dpo_kind=ipo does not apply to algo.name=simpo (its loss has no such term); remove it"),
        (["algo.name=reward_model", "algo.beta=0.5"],
         "algo.beta=0.5 does not apply to algo.name=reward_model (its loss has no such term); remove it"),
    ],
)
def test_a_key_the_algorithm_would_ignore_is_refused(overrides, expected):
    assert problems(*overrides) == [expected]


def test_keys_the_algorithm_reads_are_not_reported():
    # each algorithm with the keys it reads set away from their defaults
    assert problems("algo.name=ppo", "algo.lam=0.9", "algo.gamma=0.99", "algo.value_clip=0.1", "algo.critic_lr=1e-5",
                    "algo.critic_warmup_steps=2", "model.critic_path=/m", "algo.kl_coef=0.1", "algo.kl_in_reward=true",
                    "algo.kl_target=0.1", "algo.kl_horizon=100", REWARD) == []
    assert problems("algo.name=grpo", "algo.adv_scale=none", REWARD) == []  # adv_eps is then unread
    assert problems("algo.name=grpo", "algo.adv_eps=1e-4", "algo.clip_high=0.3",
                    "algo.dynamic_sampling=true", "algo.max_refill_rounds=2", "algo.overlong_buffer=2",
                    "algo.overlong_penalty=0.5", "algo.importance_correction=token-truncate", "algo.importance_cap=3",
                    "algo.kl_coef=0.1", "algo.kl_kind=k2", "algo.epochs=2", "algo.minibatches=2", REWARD) == []
    assert problems("algo.name=dpo", "algo.beta=0.3", "algo.dpo_kind=robust", "algo.label_smoothing=0.1", "algo.epochs=2") == []
    assert problems("algo.name=simpo", "algo.beta=1.0", "algo.simpo_gamma=0.5") == []
    # the preset's own values are its defaults (GSPO's narrow clip, DAPO's dynamic sampling)
    assert problems("algo.name=dapo", "algo.max_refill_rounds=2", REWARD) == []


def test_every_algo_key_has_a_use_rule():
    # a new key of the algo section must say which algorithms read it; every algorithm
    # reads epochs and minibatches, and skip_zero_advantage has rules of its own
    from rltune.algos.registry import _KEY_USE

    assert set(AlgoConfig.model_fields) - set(_KEY_USE) == {"name", "epochs", "minibatches", "skip_zero_advantage"}


def test_grpo_and_sft_entries():
    grpo, sft = ALGORITHMS["grpo"], ALGORITHMS["sft"]
    assert (grpo.online, grpo.needs_critic) == (True, False)
    assert (grpo.advantage, grpo.loss) == (group_advantages, ppo_policy_loss)
    assert (sft.online, sft.needs_critic, sft.advantage, sft.loss) == (False, False, None, sft_loss)
    # GRPO loads a reference model only for a KL penalty
    assert not grpo.requires_reference(0.0) and grpo.requires_reference(0.05)
    assert not sft.requires_reference(0.0) and not sft.requires_reference(0.05)


def test_algorithm_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ALGORITHMS["grpo"].online = False  # type: ignore[misc]
    assert isinstance(ALGORITHMS["sft"], Algorithm)


ALLOWED_ROOTS = {"torch", "__future__", "dataclasses", "typing", "collections", "math"}


def test_algos_imports_torch_and_itself_only():
    package = pathlib.Path(algos.__file__).parent
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                ok = (module.split(".")[0] in ALLOWED_ROOTS or module.startswith("rltune.algos")
                      or module == "rltune.metrics.types")  # metrics as data: Max, Sum
                assert ok, f"{path.name}:{node.lineno} imports {module}"


def test_a_registered_entry_may_read_any_algo_key(monkeypatch):
    # its own functions may read what the built-in ones do not (here adv_scale through
    # GRPO's kwargs with another estimator, and beta in a loss of its own)
    from rltune.algos import group_baseline
    from rltune.algos.registry import group_advantage_kwargs, online_algorithm

    entry = online_algorithm("mine", group_baseline, advantage_kwargs=group_advantage_kwargs)
    monkeypatch.setitem(ALGORITHMS, "mine", entry)
    assert problems("algo.name=mine", "algo.adv_scale=none", "algo.beta=0.5", REWARD) == []
    assert problems("algo.name=mine", "model.critic_path=/m", REWARD) == [
        "model.critic_path does not apply to algo.name=mine (it has no critic); remove it"]


def test_critic_warmup_without_a_critic_says_what_it_would_do():
    assert problems("algo.name=grpo", "algo.critic_warmup_steps=3", REWARD) == [
        "algo.critic_warmup_steps=3 does not apply to algo.name=grpo (it has no critic to warm up: "
        "the policy would not learn for those steps); remove it"]
