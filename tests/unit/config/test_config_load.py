"""Loading the experiment config: YAML, dotted overrides, readable errors, resolved dump."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from rltune.config import (
    AlgoConfig,
    Config,
    ConfigError,
    RewardFnConfig,
    TrainConfig,
    config_base_dir,
    dump_config,
    load_config,
    save_resolved_config,
)

REWARD = "reward:\n  - {fn: 'rewards.py:exact'}\n"


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    # never pydantic's own dump
    assert "errors.pydantic.dev" not in message and "Extra inputs" not in message
    return message


# ---- typos --------------------------------------------------------------------------


def test_top_level_typo_names_key_closest_and_file(tmp_path):
    path = write(tmp_path, REWARD + "modle: {path: x}\n")
    message = error_of(path)
    assert "unknown key `modle`; did you mean `model`?" in message
    assert str(path) in message


def test_nested_typo(tmp_path):
    message = error_of(write(tmp_path, REWARD + "train: {lrr: 0.1}\n"))
    assert "unknown key `train.lrr`; did you mean `train.lr`?" in message


def test_typo_inside_list_item(tmp_path):
    message = error_of(write(tmp_path, "reward:\n  - {fn: 'a:b', wieght: 2}\n"))
    assert "unknown key `reward[0].wieght`; did you mean `reward[0].weight`?" in message


def test_no_close_match_lists_valid_keys_of_that_section(tmp_path):
    message = error_of(write(tmp_path, REWARD + "log: {zzzzzz: 1}\n"))
    assert "unknown key `log.zzzzzz`; valid keys in `log`: dir, console, samples_per_step" in message


def test_override_typos(tmp_path):
    path = write(tmp_path, REWARD)
    message = error_of(path, ["train.lrr=1e-4", "reward.0.wieght=2", "modle.path=x"])
    assert "override `train.lrr=1e-4`: unknown key `train.lrr`; did you mean `train.lr`?" in message
    assert "unknown key `reward[0].wieght`; did you mean `reward[0].weight`?" in message
    assert "unknown key `modle`; did you mean `model`?" in message
    assert "(3 problems)" in message and str(path) in message


def test_override_bad_shapes(tmp_path):
    message = error_of(
        write(tmp_path, REWARD),
        ["no_equals_sign", "reward.x=1", "train.lr.sub=1", "reward.5.fn=a:b", "train.betas.2=0.9"],
    )
    assert "override `no_equals_sign`: expected KEY=VALUE" in message
    assert "`reward` is a list; index it with a number" in message
    assert "`train.lr` is a single value, it has no key `sub`" in message
    assert "`reward` has 1 items; index 5 is past the end (index 1 adds one)" in message
    assert "`train.betas` has exactly 2 items; no index 2" in message
    assert "(5 problems)" in message


# ---- overrides: values and lists ----------------------------------------------------


def test_override_coercions(tmp_path):
    cfg = load_config(
        write(tmp_path, REWARD),
        ["train.lr=1e-4", "train.steps=5", "checkpoint.resume=auto", 'rollout.stop=["\\n"]'],
    )
    # YAML reads `1e-4` (no dot) as text; the float field turns it into the number
    assert yaml.safe_load("1e-4") == "1e-4"
    assert type(cfg.train.lr) is float and cfg.train.lr == 1e-4
    assert type(cfg.train.steps) is int and cfg.train.steps == 5
    assert cfg.checkpoint.resume == "auto"
    assert cfg.rollout.stop == ("\n",)


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    cfg = load_config(write(tmp_path, REWARD + "train: {lr: 3e-6}\nmodel: {router_aux_loss_coef: 1e-2}\n"))
    assert cfg.train.lr == 3e-6 and cfg.model.router_aux_loss_coef == 1e-2


def test_text_field_keeps_override_text_as_written(tmp_path):
    cfg = load_config(write(tmp_path, REWARD), ["name=2024", "data.system_prompt=Answer: briefly", "data.eval=null"])
    assert cfg.name == "2024"
    assert cfg.data.system_prompt == "Answer: briefly"
    assert cfg.data.eval is None


def test_override_list_items(tmp_path):
    path = write(tmp_path, REWARD)
    cfg = load_config(
        path,
        ["reward.0.weight=2", "reward.1.fn=b:c", "reward.1.kwargs.k=3", "train.betas.1=0.95", "rollout.stop.0=END"],
    )
    assert cfg.reward == (
        RewardFnConfig(fn="rewards.py:exact", weight=2.0),
        RewardFnConfig(fn="b:c", kwargs={"k": 3}),
    )
    assert cfg.train.betas == (0.9, 0.95)  # an unset list starts from its default
    assert cfg.rollout.stop == ("END",)
    # a whole item, and overrides apply in order
    cfg = load_config(path, ["reward.0={fn: 'x:y', weight: 0.5}", "reward.0.weight=4"])
    assert cfg.reward == (RewardFnConfig(fn="x:y", weight=4.0),)


def test_overrides_without_file():
    cfg = load_config(None, ["algo.name=sft", "train.steps=3"])
    assert cfg == Config(algo=AlgoConfig(name="sft"), train=TrainConfig(steps=3))


# ---- invalid values -----------------------------------------------------------------


def test_invalid_values_all_listed(tmp_path):
    path = write(
        tmp_path,
        """\
        reward: [{fn: 'a:b'}]
        train: {steps: -1, lr: fast, threads: many}
        algo: {group_size: 0}
        rollout: {top_p: 2, stop: END}
        model: 5
        """,
    )
    message = error_of(path)
    for line in [
        "train.steps: must be >= 0 (got -1)",
        "train.lr: must be a valid number, unable to parse string as a number (got 'fast')",
        "train.threads: must be a valid integer, unable to parse string as an integer (got 'many')",
        "algo.group_size: must be >= 1 (got 0)",
        "rollout.top_p: must be <= 1.0 (got 2)",
        "rollout.stop: must be a list (got 'END')",
        "model: must be a mapping of keys (got 5)",
    ]:
        assert f"  - {line}\n" in message + "\n", line
    assert "(7 problems)" in message


def test_missing_required_key(tmp_path):
    message = error_of(write(tmp_path, "reward:\n  - {weight: 2}\n"))
    assert "reward[0].fn: required key is missing" in message


def test_invalid_value_from_override_names_it(tmp_path):
    message = error_of(write(tmp_path, REWARD), ["train.steps=-3"])
    assert "train.steps: must be >= 0 (got -3) (set by override `train.steps=-3`)" in message


def test_schema_cross_checks_are_config_errors(tmp_path):
    message = error_of(write(tmp_path, REWARD + "runtime: {max_staleness: 1}\n"))
    assert message == (
        f"invalid config {tmp_path / 'exp.yaml'}:\n  - runtime.max_staleness > 0 learns on samples of "
        "older policies; set algo.importance_correction to token-truncate or seq-mask so the loss "
        "weighs them by the engine's log-probs"
    )
    message = error_of(write(tmp_path, REWARD + "algo: {kl_target: 0.1}\n"))
    assert "algo.kl_target adapts the KL in the reward" in message and "Value error" not in message

    # a section's own check that names its key is not prefixed with the section again
    message = error_of(write(tmp_path, REWARD + "train: {offload: optimizer, precision: fp16}\n"))
    assert message.split("\n")[1].startswith("  - train.offload: optimizer with precision fp16: ")


@pytest.mark.parametrize("name", ["mean", "std", "errors", "timeouts", "dropped", "min", "max"])
def test_a_reward_named_like_a_statistic_of_the_total_is_refused(tmp_path, name):
    text = f"reward:\n  - {{fn: builtin:exact_numeric}}\n  - {{fn: builtin:exact_numeric, name: {name}}}\n"
    message = error_of(write(tmp_path, text))
    assert f"reward[1] (builtin:exact_numeric): the name {name!r} is reserved: reward/{name} is a statistic" in message
    assert "give it another `name:`" in message and "\n" not in message.split("  - ", 1)[1]


def test_a_reward_spec_without_a_function_is_named_as_a_spec_problem(tmp_path):
    message = error_of(write(tmp_path, "reward:\n  - {fn: 'r.py:'}\n"))
    assert "reward[0].fn='r.py:' names no function after ':'; expected `module:function`" in message
    assert "name:" not in message


def test_a_reward_named_like_a_reward_the_run_adds_itself_is_refused(tmp_path):
    overlong = "reward:\n  - {fn: builtin:overlong, kwargs: {max_chars: 10, buffer_chars: 2}}\n"
    assert load_config(write(tmp_path, overlong)).reward[0].fn == "builtin:overlong"  # the run adds no overlong
    message = error_of(write(tmp_path, overlong + "algo: {overlong_buffer: 2}\n"))
    assert "reward[0] (builtin:overlong): the name 'overlong' is reserved: this run adds a reward" in message
    assert load_config(write(tmp_path, overlong), ["reward.0.name=chars", "algo.overlong_buffer=2"]).reward[0].name == "chars"
    env = "reward:\n  - {fn: my_rewards.py:score, name: env}\nenv: {name: builtin:tools}\n"
    assert "reward[0] (my_rewards.py:score): the name 'env' is reserved" in error_of(write(tmp_path, env))
    assert "the name 'a/b' contains '/'" in error_of(write(tmp_path, "reward:\n  - {fn: x.py:f, name: a/b}\n"))


# ---- files --------------------------------------------------------------------------


def test_empty_file_is_all_defaults(tmp_path):
    for text in ["", "# only a comment\n"]:
        path = write(tmp_path, text)
        assert load_config(path, ["algo.name=sft"]) == Config(algo=AlgoConfig(name="sft"))
        # defaults alone are no experiment: the message says the file is empty
        message = error_of(path)
        assert message.startswith(f"config file {path} is empty (or only comments), so every setting would be")
        assert "recipes/" in message


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just text\n", "str"), ("3\n", "int")])
def test_non_mapping_top_level(tmp_path, text, kind):
    path = write(tmp_path, text)
    message = error_of(path)
    assert str(path) in message and "top level must be a mapping" in message and f"got a {kind}" in message


def test_file_not_found_names_path(tmp_path):
    path = tmp_path / "missing" / "exp.yaml"
    assert error_of(path) == f"config file not found: {path}"


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_bytes(b"name: \xff\n")
    assert error_of(path) == f"config file {path} is not UTF-8 text (byte 6: invalid start byte); save it as UTF-8"


@pytest.mark.parametrize("override, fragment", [
    ("eval.max_prompts=0", "eval.max_prompts: must be >= 1"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens: must be >= 1"),  # not "use rollout.max_new_tokens"
    ("train.threads=0", "train.threads: must be >= 1"),  # not torch's default
    ("train.seed=-5", "train.seed: must be >= 0"),  # numpy takes 0 to 2**32 - 1
    ("train.seed=4294967296", "train.seed: must be < 4294967296"),
    ("train.betas=[0.9,1.5]", "train.betas[1]: must be < 1"),
    ("train.lr=inf", "train.lr: must be a finite number"),
    ("train.weight_decay=inf", "train.weight_decay: must be a finite number"),
    ("rollout.temperature=inf", "rollout.temperature: must be a finite number"),
    ('rollout.stop=[""]', "rollout.stop[0]"),  # an empty stop string would end every completion at once
    ("log.samples_per_step=-1", "log.samples_per_step: must be >= 0"),
])
def test_values_outside_what_the_run_can_use_are_refused(override, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(None, [override])


def test_invalid_yaml_and_duplicate_keys(tmp_path):
    path = write(tmp_path, "train: {lr: [1,\n")
    message = error_of(path)
    assert f"config file {path} is not valid YAML" in message and f'in "{path}", line 2' in message
    message = error_of(write(tmp_path, REWARD + "train:\n  lr: 0.1\n  lr: 0.2\n"))
    assert "duplicate key 'lr'" in message and "line 5" in message


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_config_base_dir(tmp_path):
    path = write(tmp_path, REWARD, name="sub.yaml")
    assert config_base_dir(path) == tmp_path.resolve()
    assert config_base_dir(str(path)) == tmp_path.resolve()
    assert config_base_dir(None) == Path.cwd()


# ---- resolved config ----------------------------------------------------------------


def test_dump_has_every_field_in_schema_order():
    cfg = Config(reward=(RewardFnConfig(fn="a:b"),))
    data = yaml.safe_load(dump_config(cfg))
    assert list(data) == list(Config.model_fields)
    assert list(data["train"]) == list(TrainConfig.model_fields)
    assert data["train"]["betas"] == [0.9, 0.999]
    assert data["reward"] == [
        {"fn": "a:b", "weight": 1.0, "name": None, "kwargs": {}, "timeout_s": 60.0, "cache": True,
         "accuracy": None}
    ]


def test_round_trip_of_resolved_config(tmp_path):
    path = write(
        tmp_path,
        """\
        name: exp1
        algo: {name: grpo, group_size: 4, adv_scale: none}
        reward:
          - {fn: 'r.py:exact', weight: 0.5, kwargs: {tol: 1.0e-3, tags: [a, b]}}
          - {fn: 'r.py:length', name: len}
        rollout: {stop: ["\\n", "yes", "2024"], temperature: 0.7}
        train: {lr: 1e-4, betas: [0.9, 0.95], grad_clip: .inf}
        """,
    )
    cfg = load_config(path, ["checkpoint.resume=auto", "data.system_prompt=Answer: tersely"])
    saved = save_resolved_config(cfg, tmp_path / "runs" / "exp1")
    assert saved == tmp_path / "runs" / "exp1" / "config.yaml"
    assert sorted(p.name for p in saved.parent.iterdir()) == ["config.yaml"]
    again = load_config(saved)
    assert again == cfg
    assert again.rollout.stop == ("\n", "yes", "2024")
    assert again.train.grad_clip == float("inf")
    assert dump_config(again) == saved.read_text(encoding="utf-8")


def test_config_package_imports_no_torch():
    code = "import sys, rltune.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])


def test_algorithm_presets_fill_only_what_the_user_left_unset() -> None:
    dapo = load_config(None, ["algo.name=dapo", "reward=[{fn: builtin:exact_numeric}]"]).algo
    assert (dapo.clip_low, dapo.clip_high, dapo.dynamic_sampling) == (0.2, 0.28, True)
    mine = load_config(None, ["algo.name=dapo", "algo.clip_high=0.3", "reward=[{fn: builtin:exact_numeric}]"]).algo
    assert mine.clip_high == 0.3 and mine.dynamic_sampling
    dr = load_config(None, ["algo.name=dr_grpo", "reward=[{fn: builtin:exact_numeric}]"]).algo
    assert (dr.adv_scale, dr.aggregation) == ("none", "seq-mean-token-sum-norm")
    assert load_config(None, ["algo.name=grpo", "reward=[{fn: builtin:exact_numeric}]"]).algo.clip_high == 0.2


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["algo.name=ppo", "algo.kl_target=0.1"], "kl_target adapts the KL in the reward"),
        (["algo.name=dpo", "algo.dpo_kind=ipo", "algo.label_smoothing=0.1"], "not ipo"),
    ],
)
def test_key_combinations_that_would_do_nothing_are_errors(overrides, fragment) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, [*overrides, "reward=[{fn: builtin:exact_numeric}]"])


@pytest.mark.parametrize("override", ["algo.dual_clip=.inf", "algo.kl_coef=.nan", "algo.clip_high=.inf",
                                      "runtime.placement.learner.gpus=.inf", "rollout.top_p=.nan"])
def test_no_setting_outside_train_takes_an_infinite_or_nan_value(override: str) -> None:
    """Such a value passed the config and failed at the first step, or silently turned a
    term off. (``train.grad_clip: .inf``, no clipping, stays allowed.)"""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}: must be a finite number"):
        load_config(None, ["reward.0.fn=m:f", override])
