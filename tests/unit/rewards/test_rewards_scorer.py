"""build_reward_fns and LocalScorer: weighted sums, errors as data, thread pool == loop."""

from __future__ import annotations

import math
import textwrap
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError
import torch

from rltune.config.schema import RewardFnConfig
from rltune.data.records import Prompt, Rollout
from rltune.rewards.builtin import exact_numeric, format_regex
from rltune.rewards.loading import RewardLoadError
from rltune.rewards.scorer import LocalScorer, RewardFn, ScoreStats, build_reward_fns


def by_fn(stats: ScoreStats, field: str) -> dict[str, float]:
    """One statistic of each reward function, as plain numbers."""
    return {name: getattr(fn, field).value for name, fn in stats.per_fn.items()}


def _rollout(prompt_id: str, text: str, group: int = 0) -> Rollout:
    return Rollout(
        prompt_id=prompt_id,
        group=group,
        prompt_ids=torch.tensor([1, 2]),
        completion_ids=torch.tensor([3, 4]),
        completion_logprobs=None,
        loss_mask=torch.ones(2),
        text=text,
        finish_reason="stop",
        policy_version=0,
    )


PROMPTS = {
    "a": Prompt(id="a", text="2+2?", meta={"answer": "4"}),
    "b": Prompt(id="b", text="3*3?", meta={"answer": 9}),
}

ANSWER_TAG = r"<answer>.*</answer>"


def test_weighted_sum_by_hand() -> None:
    fns = [
        RewardFn("correct", exact_numeric, 1.0),
        RewardFn("format", format_regex, 0.5, {"pattern": ANSWER_TAG}),
    ]
    rollouts = [
        _rollout("a", "<answer>4</answer>"),  # correct 1, format 1 -> 1 + 0.5 = 1.5
        _rollout("a", "4"),  # correct 1, format 0 -> 1.0
        _rollout("b", "<answer>8</answer>"),  # correct 0, format 1 -> 0.5
        _rollout("b", "no idea"),  # correct 0, format 0 -> 0.0
    ]
    stats = LocalScorer(fns).score(PROMPTS, rollouts)
    assert [r.reward for r in rollouts] == [1.5, 1.0, 0.5, 0.0]
    assert [r.rewards for r in rollouts] == [
        {"correct": 1.0, "format": 1.0},
        {"correct": 1.0, "format": 0.0},
        {"correct": 0.0, "format": 1.0},
        {"correct": 0.0, "format": 0.0},
    ]
    assert all(r.reward_error is None for r in rollouts)
    assert stats.errors.value == 0
    assert by_fn(stats, "mean") == {"correct": 0.5, "format": 0.5}
    assert by_fn(stats, "errors") == {"correct": 0, "format": 0}
    assert set(by_fn(stats, "seconds")) == {"correct", "format"}
    assert all(s >= 0.0 for s in by_fn(stats, "seconds").values())


def test_meta_is_prompt_meta_merged_with_kwargs_and_kwargs_win() -> None:
    seen: list[dict[str, object]] = []

    def record(prompt: Prompt, completion: str, **meta: object) -> float:
        seen.append(meta)
        return 1.0

    prompts = {"a": Prompt(id="a", text="q", meta={"answer": "4", "pattern": "from-data"})}
    fns = [RewardFn("record", record, 1.0, {"pattern": "from-config", "extra": 2})]
    LocalScorer(fns).score(prompts, [_rollout("a", "x")])
    assert seen == [{"answer": "4", "pattern": "from-config", "extra": 2}]
    assert prompts["a"].meta == {"answer": "4", "pattern": "from-data"}  # not mutated


def _flaky(prompt: Prompt, completion: str, **meta: object) -> float | None:
    if completion == "boom":
        raise RuntimeError("judge timed out")
    if completion == "skip":
        return None
    return float(len(completion))


def test_raising_and_none_samples_are_masked_and_counted() -> None:
    fns = [RewardFn("len", _flaky, 2.0), RewardFn("correct", exact_numeric, 1.0)]
    rollouts = [
        _rollout("a", "4"),  # len 1 * 2 + correct 1 = 3
        _rollout("a", "boom"),
        _rollout("b", "skip"),
        _rollout("b", "9 9"),  # len 3 * 2 + correct 1 = 7
        _rollout("a", "boom"),
    ]
    stats = LocalScorer(fns).score(PROMPTS, rollouts)
    assert [r.reward for r in rollouts] == [3.0, None, None, 7.0, None]
    assert [r.reward_error for r in rollouts] == [
        None,
        "len: RuntimeError: judge timed out",
        "len: returned None",
        None,
        "len: RuntimeError: judge timed out",
    ]
    # The functions that did score a failed sample still report their value.
    assert rollouts[1].rewards == {"len": None, "correct": 0.0}
    assert stats.errors.value == 3
    assert by_fn(stats, "errors") == {"len": 3, "correct": 0}
    assert by_fn(stats, "mean")["len"] == pytest.approx((1.0 + 3.0) / 2, abs=1e-12)
    assert by_fn(stats, "mean")["correct"] == pytest.approx(2 / 5, abs=1e-12)


def test_shards_scored_apart_combine_to_the_stats_of_one_call() -> None:
    # Two scorers each take a share, as the Ray scorer actors do. "len"'s values are
    # 1, 3 in the first share and 6 in the second: the combined mean is 10 / 3, each
    # value counted once (the mean of the shares' means would be 4).
    fns = [RewardFn("len", _flaky), RewardFn("correct", exact_numeric)]
    texts = ["4", "boom", "9 9", "skip", "666666", "boom"]
    whole = [_rollout("ab"[i % 2], t) for i, t in enumerate(texts)]
    parts = [whole[:3], whole[3:]]
    stats = [LocalScorer(fns).score(PROMPTS, part) for part in parts]
    combined = ScoreStats.combine(stats)
    one = LocalScorer(fns).score(PROMPTS, [_rollout("ab"[i % 2], t) for i, t in enumerate(texts)])
    assert by_fn(combined, "mean")["len"] == pytest.approx(10 / 3, abs=1e-12)
    assert by_fn(combined, "mean")["correct"] == pytest.approx(by_fn(one, "mean")["correct"], abs=1e-12)
    assert by_fn(combined, "errors") == by_fn(one, "errors") == {"len": 3, "correct": 0}
    # the two "boom"s of prompt b are one call in one round, one call per share apart
    assert by_fn(one, "calls") == {"len": 5, "correct": 5}
    assert by_fn(combined, "calls") == {"len": 6, "correct": 6}
    assert combined.errors.value == one.errors.value == 3
    assert list(combined.metrics()) == list(one.metrics())
    # a share where a function gave no value: its mean is of nothing, and adds nothing
    nothing = LocalScorer(fns).score(PROMPTS, [_rollout("a", "boom")])
    assert math.isnan(by_fn(nothing, "mean")["len"])
    again = ScoreStats.combine([nothing, ScoreStats.combine(stats), nothing])
    assert by_fn(again, "mean")["len"] == pytest.approx(10 / 3, abs=1e-12)
    assert math.isnan(by_fn(ScoreStats.combine([nothing, nothing]), "mean")["len"])
    empty = ScoreStats.combine([])
    assert empty.per_fn == {} and empty.errors.value == 0


def test_first_failure_in_config_order_is_reported() -> None:
    def bad_a(prompt: Prompt, completion: str, **meta: object) -> float:
        raise KeyError("tests")

    def bad_b(prompt: Prompt, completion: str, **meta: object) -> None:
        return None

    rollout = _rollout("a", "x")
    stats = LocalScorer([RewardFn("b", bad_b), RewardFn("a", bad_a)]).score(PROMPTS, [rollout])
    assert rollout.reward is None
    assert rollout.reward_error == "b: returned None"
    assert by_fn(stats, "errors") == {"b": 1, "a": 1}
    assert stats.errors.value == 1
    assert math.isnan(by_fn(stats, "mean")["a"]) and math.isnan(by_fn(stats, "mean")["b"])


def test_data_error_from_builtin_is_reported_not_scored_zero() -> None:
    prompts = {"c": Prompt(id="c", text="q", meta={})}  # the row has no answer
    rollout = _rollout("c", "4")
    stats = LocalScorer([RewardFn("correct", exact_numeric)]).score(prompts, [rollout])
    assert rollout.reward is None
    assert rollout.reward_error is not None
    assert rollout.reward_error.startswith("correct: ValueError: prompt 'c': exact_numeric needs")
    assert stats.errors.value == 1


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("1.0", "returned str '1.0'"),
        ([1.0], "returned list [1.0]"),
        (float("nan"), "returned float nan"),
        (float("inf"), "returned float inf"),
        (-float("inf"), "returned float -inf"),
        (torch.tensor(1.0), "returned Tensor tensor(1.)"),
        # finite in float64, inf in float32, where training reads rewards
        (1e300, "returned float 1e+300 (expected a finite number within float32's range, where training reads "
                "rewards: |r| <= 3.4e38)"),
        (-(10**40), "returned int -10000000000000000000000000000000000000000 (expected a finite number within "
                    "float32's range, where training reads rewards: |r| <= 3.4e38)"),
    ],
)
def test_non_numeric_returns_are_errors(value: object, fragment: str) -> None:
    rollout = _rollout("a", "x")
    stats = LocalScorer([RewardFn("odd", lambda p, c, **m: value)]).score(PROMPTS, [rollout])
    assert rollout.reward is None
    assert rollout.rewards == {"odd": None}
    assert rollout.reward_error == (f"odd: {fragment}" if "expected" in fragment else f"odd: {fragment} (expected a finite number)")
    assert stats.errors.value == 1


def test_a_weighted_sum_past_float32s_range_is_an_error() -> None:
    # each value is in range; 3e38 + 2 * 3e38 is not (training reads rewards in float32)
    fns = [RewardFn("a", lambda p, c, **m: 3e38), RewardFn("b", lambda p, c, **m: 3e38, 2.0)]
    rollout = _rollout("a", "x")
    stats = LocalScorer(fns).score(PROMPTS, [rollout])
    assert rollout.reward is None and rollout.rewards == {"a": 3e38, "b": 3e38}
    assert rollout.reward_error == ("the weighted sum 9e+38 is not a finite number within float32's range, "
                                    "where training reads rewards: |r| <= 3.4e38")
    assert stats.errors.value == 1


def test_long_error_messages_are_kept_up_to_a_bound() -> None:
    def chatty(prompt: Prompt, completion: str, **meta: object) -> float:
        raise ValueError("x" * 500 if completion == "short" else "y" * 5000)

    rollouts = [_rollout("a", "short"), _rollout("a", "long")]
    LocalScorer([RewardFn("chatty", chatty)]).score(PROMPTS, rollouts)
    assert rollouts[0].reward_error == "chatty: ValueError: " + "x" * 500
    assert rollouts[1].reward_error == "chatty: ValueError: " + "y" * 2000 + "... (3000 more characters)"


def test_bool_and_int_returns_are_numbers() -> None:
    fns = [RewardFn("flag", lambda p, c, **m: c == "yes", 3.0), RewardFn("n", lambda p, c, **m: 2)]
    rollouts = [_rollout("a", "yes"), _rollout("a", "no")]
    LocalScorer(fns).score(PROMPTS, rollouts)
    assert [r.reward for r in rollouts] == [3.0 * 1.0 + 2.0, 3.0 * 0.0 + 2.0]
    assert rollouts[0].rewards == {"flag": 1.0, "n": 2.0}
    assert all(type(v) is float for v in rollouts[0].rewards.values())


def test_rescoring_overwrites_previous_results() -> None:
    rollout = _rollout("a", "boom")
    LocalScorer([RewardFn("len", _flaky)]).score(PROMPTS, [rollout])
    assert rollout.reward_error is not None
    LocalScorer([RewardFn("correct", exact_numeric)]).score(PROMPTS, [rollout])
    assert rollout.rewards == {"correct": 0.0}
    assert rollout.reward == 0.0 and rollout.reward_error is None


def test_unknown_prompt_id_is_a_caller_bug() -> None:
    with pytest.raises(KeyError, match="prompt ids not passed to score"):
        LocalScorer([RewardFn("len", _flaky)]).score(PROMPTS, [_rollout("zzz", "x")])


def test_empty_batch() -> None:
    stats = LocalScorer([RewardFn("len", _flaky)]).score(PROMPTS, [])
    assert stats.errors.value == 0 and by_fn(stats, "errors") == {"len": 0}
    assert math.isnan(by_fn(stats, "mean")["len"])


def test_thread_pool_matches_loop_and_uses_threads() -> None:
    threads: set[str] = set()

    def slow_len(prompt: Prompt, completion: str, **meta: object) -> float | None:
        threads.add(threading.current_thread().name)
        time.sleep(0.002)
        return _flaky(prompt, completion)

    fns = [RewardFn("len", slow_len, 0.25), RewardFn("correct", exact_numeric, 1.0)]
    texts = ["4", "boom", "9", "skip", "<answer>4</answer>", "12", "x", "4 4"] * 3
    loop_rollouts = [_rollout("ab"[i % 2], t, i) for i, t in enumerate(texts)]
    pool_rollouts = [_rollout("ab"[i % 2], t, i) for i, t in enumerate(texts)]
    loop_stats = LocalScorer(fns).score(PROMPTS, loop_rollouts)
    threads.clear()
    pool_stats = LocalScorer(fns, max_workers=4).score(PROMPTS, pool_rollouts)
    assert len(threads) > 1
    for mine, theirs in zip(pool_rollouts, loop_rollouts):
        assert (mine.reward, mine.rewards, mine.reward_error) == (
            theirs.reward,
            theirs.rewards,
            theirs.reward_error,
        )
    assert pool_stats.errors.value == loop_stats.errors.value == 6
    assert by_fn(pool_stats, "mean") == by_fn(loop_stats, "mean")
    assert by_fn(pool_stats, "errors") == by_fn(loop_stats, "errors")


def test_scorer_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        LocalScorer([RewardFn("len", _flaky)], max_workers=0)
    with pytest.raises(ValueError, match="pool must be 'thread' or 'process'"):
        LocalScorer([RewardFn("len", _flaky)], pool="fiber")


def test_without_reward_functions_only_episodes_get_a_reward() -> None:
    plain, episode, failed = _rollout("a", "x"), _rollout("a", "y"), _rollout("a", "z")
    episode.turns, episode.env_reward = [{"role": "assistant", "content": "y"}], 0.75
    failed.turns, failed.env_error = [], "env: step raised KeyError: 'q'"
    with LocalScorer([]) as scorer:
        stats = scorer.score(PROMPTS, [plain, episode, failed])
    assert plain.reward is None and "no reward function" in plain.reward_error
    assert episode.reward == 0.75 and episode.rewards == {"env": 0.75}
    assert failed.reward is None and failed.reward_error == "env: step raised KeyError: 'q'"
    assert stats.errors.value == 2


def test_episode_rewards_add_the_env_reward_and_functions_see_the_turns() -> None:
    seen = []

    def tool_user(prompt, completion, *, turns=(), **meta):
        seen.append(turns)
        return float(sum(t["role"] == "tool" for t in turns))

    r = _rollout("a", "42")
    r.turns = [{"role": "assistant", "content": "<tool_call>..."}, {"role": "tool", "content": "7"},
               {"role": "assistant", "content": "42"}]
    r.env_reward = 0.5
    with LocalScorer([RewardFn("tools", tool_user, weight=2.0)]) as scorer:
        scorer.score(PROMPTS, [r])
    assert seen == [r.turns]
    assert r.rewards == {"tools": 1.0, "env": 0.5} and r.reward == 2.0 * 1.0 + 0.5


# build_reward_fns ----------------------------------------------------------------------

USER_FILE = textwrap.dedent(
    """
    def my_reward(prompt, completion, **kw):
        return kw["scale"] * len(completion)

    def strict(prompt, completion, answer=None):
        return 1.0

    lam = lambda prompt, completion, **kw: 1.0
    """
)


def _user_file(tmp_path: Path) -> Path:
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_FILE)
    return path


def test_build_from_config_and_score(tmp_path: Path) -> None:
    _user_file(tmp_path)
    configs = [
        RewardFnConfig(fn="builtin:exact_numeric"),
        RewardFnConfig(fn="user_rewards.py:my_reward", weight=0.5, kwargs={"scale": 2.0}),
    ]
    fns = build_reward_fns(configs, base_dir=str(tmp_path))
    assert [(f.name, f.weight, dict(f.kwargs)) for f in fns] == [
        ("exact_numeric", 1.0, {}),
        ("my_reward", 0.5, {"scale": 2.0}),
    ]
    assert fns[0].fn is exact_numeric
    rollout = _rollout("a", "4")
    stats = LocalScorer(fns).score(PROMPTS, [rollout])
    assert isinstance(stats, ScoreStats)
    assert rollout.rewards == {"exact_numeric": 1.0, "my_reward": 2.0}
    assert rollout.reward == 1.0 + 0.5 * 2.0


def test_duplicate_names_ask_for_name(tmp_path: Path) -> None:
    configs = [RewardFnConfig(fn="builtin:format_regex", kwargs={"pattern": p}) for p in "ab"]
    with pytest.raises(RewardLoadError, match="two reward functions are named 'format_regex'.*`name:`"):
        build_reward_fns(configs)
    named = [
        RewardFnConfig(fn="builtin:format_regex", name=f"fmt_{p}", kwargs={"pattern": p})
        for p in "ab"
    ]
    assert [f.name for f in build_reward_fns(named)] == ["fmt_a", "fmt_b"]


def test_kwargs_the_function_cannot_take(tmp_path: Path) -> None:
    path = _user_file(tmp_path)
    config = RewardFnConfig(fn=f"{path}:strict", kwargs={"answer": 1, "scal": 2})
    with pytest.raises(RewardLoadError, match=r"kwargs \['scal'\] are not parameters"):
        build_reward_fns([config])
    config = RewardFnConfig(fn="builtin:exact_numeric", kwargs={"prompt": "x"})
    with pytest.raises(RewardLoadError, match=r"may not be named \['prompt'\]"):
        build_reward_fns([config])


def test_a_builtins_kwargs_are_checked_when_the_config_loads() -> None:
    # the built-ins take the dataset's other fields as ``**_`` and ignore them; a config
    # kwarg they do not name would be ignored too, so it is refused with the closest name
    typo = RewardFnConfig(fn="builtin:format_regex", kwargs={"patern": "x"})
    with pytest.raises(RewardLoadError, match=r"kwargs \['patern'\] are not parameters of the function "
                                              r"\(it accepts \['pattern'\]\); did you mean 'pattern'\?"):
        build_reward_fns([typo])
    bad_regex = RewardFnConfig(fn="builtin:format_regex", kwargs={"pattern": "(<answer>"})
    with pytest.raises(RewardLoadError, match=r"reward 'format_regex': kwargs.pattern '\(<answer>' is not a regular "
                                              r"expression \(missing \), unterminated subpattern"):
        build_reward_fns([bad_regex])
    ok = RewardFnConfig(fn="builtin:length_penalty", kwargs={"max_chars": 10, "cap": 0.5})
    assert [rf.name for rf in build_reward_fns([ok])] == ["length_penalty"]


@pytest.mark.parametrize(("fn", "kwargs", "message"), [
    # a batched reward gets only the config's kwargs: a required one missing would fail every call
    ("builtin:llm_judge", {"model": "m"}, r"reward 'llm_judge': kwargs \['base_url'\] are required"),
    ("builtin:reward_model", {}, r"reward 'reward_model': kwargs \['path'\] are required"),
    ("builtin:reward_model", {"path": "/nowhere/rm"}, r"kwargs.path '/nowhere/rm' is not a directory"),
    ("builtin:safety", {"action": "penalise"}, r"kwargs.action must be penalize or drop, got 'penalise'"),
    ("builtin:code_tests", {"timeout_s": 0}, r"kwargs.timeout_s must be a number > 0, got 0"),
    ("builtin:code_tests", {"memory_mb": -1}, r"kwargs.memory_mb must be a number > 0, got -1"),
])
def test_a_builtin_rewards_settings_are_checked_when_the_config_loads(fn, kwargs, message) -> None:
    with pytest.raises(RewardLoadError, match=message):
        build_reward_fns([RewardFnConfig(fn=fn, kwargs=kwargs)])


def test_lambda_is_named_by_its_spec_and_weights_must_be_finite(tmp_path: Path) -> None:
    path = _user_file(tmp_path)
    assert build_reward_fns([RewardFnConfig(fn=f"{path}:lam")])[0].name == "lam"
    # refused where the config is made, before any reward is built
    with pytest.raises(ValidationError, match=r"weight\n  Input should be a finite number"):
        RewardFnConfig(fn=f"{path}:lam", weight=float("nan"))
    # a config built without validation still meets the builder's own check
    unchecked = RewardFnConfig(fn=f"{path}:lam").model_copy(update={"weight": float("nan")})
    with pytest.raises(RewardLoadError, match="weight nan is not finite"):
        build_reward_fns([unchecked])


def test_load_errors_propagate_from_build() -> None:
    with pytest.raises(RewardLoadError, match="did you mean 'exact_numeric'"):
        build_reward_fns([RewardFnConfig(fn="builtin:exact_number")])
