"""The episode runner: token layout and loss masks of multi-turn rollouts, checked token
by token against the chat template, with a scripted generator standing in for the model
(so that every turn's tokens are known in advance)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from rltune.data.chat import encode_prompt
from rltune.data.records import Prompt, Rollout, SamplingParams
from rltune.envs.base import MAX_OBSERVATION_CHARS, StepResult
from rltune.envs.episodes import EpisodeGenerator
from rltune.envs.tool_format import format_tool_call, ToolCall, turn_glue
from rltune.envs.tools import ToolEnv, calculator
from rltune.models.tiny import build_tokenizer

TOK = build_tokenizer()
EOS = TOK.eos_token_id  # <|im_end|>


class Scripted:
    """A generator whose turns are given: each call pops the next text per row (by the
    row's prompt id), ends it with EOS unless it ends with a stop string, and reports
    log-prob -0.5 for every token."""

    version = 7

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script = {k: list(v) for k, v in script.items()}
        self.contexts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams, *, group_offset: int = 0) -> list[Rollout]:
        self.params.append(params)
        out = []
        for p in prompts:
            self.contexts.append(list(p.input_ids))
            text = self.script[p.id].pop(0)
            ids = TOK(text, add_special_tokens=False)["input_ids"]
            stopped = any(text.endswith(s) for s in params.stop)
            if not stopped:
                ids = ids + [EOS]
            ids = ids[: params.max_new_tokens]
            out.append(Rollout(
                prompt_id=p.id, group=0, prompt_ids=torch.tensor(p.input_ids),
                completion_ids=torch.tensor(ids), completion_logprobs=torch.full((len(ids),), -0.5),
                loss_mask=torch.ones(len(ids)), text=text, finish_reason="stop" if len(ids) < params.max_new_tokens or stopped else "length",
                policy_version=self.version,
            ))
        return out

    def load_weights(self, version, tensors=None) -> None:
        self.version = version


def _prompt(pid: str, text: str) -> Prompt:
    p = Prompt(id=pid, text=text)
    p.input_ids = encode_prompt(TOK, p)
    return p


def _runner(script, make_env, **kw) -> tuple[EpisodeGenerator, Scripted]:
    gen = Scripted(script)
    runner = EpisodeGenerator(
        gen, TOK, make_env, glue=turn_glue(TOK), encode=lambda p: encode_prompt(TOK, p),
        max_turns=kw.get("max_turns", 3), max_total_tokens=kw.get("max_total_tokens", 400), eos_ids=[EOS],
        max_positions=kw.get("max_positions"),
    )
    return runner, gen


CALL = format_tool_call(ToolCall("calculator", {"expression": "6*7"}))


def test_a_tool_turn_is_masked_and_laid_out_as_the_chat_template_writes_it() -> None:
    runner, gen = _runner({"q": [CALL, "42"]}, lambda: ToolEnv({"calculator": calculator}))
    prompt = _prompt("q", "6 times 7?")
    [r] = runner.generate([prompt], SamplingParams(n=1, max_new_tokens=100))
    expected_text = (
        CALL + "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n" + "42<|im_end|>"
    )
    assert TOK.decode(r.completion_ids.tolist()) == expected_text
    # the whole conversation is what the chat template renders for it
    full = TOK.apply_chat_template(
        [{"role": "user", "content": "6 times 7?"}, {"role": "assistant", "content": CALL},
         {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}], tokenize=False,
    )
    assert full.startswith(TOK.decode(prompt.input_ids + r.completion_ids.tolist()))
    n_call = len(TOK(CALL, add_special_tokens=False)["input_ids"])
    n_obs = len(TOK("<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    n_answer = 3  # "4", "2", EOS
    assert r.loss_mask.tolist() == [1.0] * n_call + [0.0] * n_obs + [1.0] * n_answer
    assert r.completion_logprobs.tolist() == [-0.5] * n_call + [0.0] * n_obs + [-0.5] * n_answer
    assert r.text == "42" and r.finish_reason == "stop" and r.env_reward == 0.0 and r.policy_version == 7
    assert [(t["role"], t["content"], t["tokens"], t["trained"]) for t in r.turns] == [
        ("assistant", CALL, n_call, True), ("tool", "42", n_obs, False), ("assistant", "42", n_answer, True),
    ]
    # the second turn was generated on the prompt, the call and the observation
    assert gen.contexts[1] == prompt.input_ids + r.completion_ids[: n_call + n_obs].tolist()
    assert "</tool_call>" in gen.params[0].stop


def test_groups_rewards_errors_and_limits() -> None:
    class Counting:
        def __init__(self) -> None:
            self.n = 0

        def reset(self, prompt):
            return None

        def step(self, action):
            self.n += 1
            if action == "boom":
                raise KeyError("no such state")
            return StepResult(observation=f"seen {self.n}", reward=0.25, done=action == "stop")

    script = {"a": ["go", "stop", "go", "go"], "b": ["boom", "boom"]}
    runner, _ = _runner(script, Counting, max_turns=3)
    rollouts = runner.generate([_prompt("a", "A"), _prompt("b", "B")], SamplingParams(n=2, max_new_tokens=20), group_offset=5)
    assert [r.group for r in rollouts] == [5, 5, 6, 6]
    first, second, failed = rollouts[0], rollouts[1], rollouts[2]
    # each round serves the live episodes in order: a1 gets "go" x3, a2 gets "stop"
    assert [t["content"] for t in first.turns] == ["go", "seen 1", "go", "seen 2", "go"]
    assert first.env_reward == 0.75 and first.finish_reason == "length"  # out of turns
    # an observation given with done is the episode's answer: scored, but not tokens
    assert [(t["content"], t["tokens"]) for t in second.turns] == [("stop", 5), ("seen 1", 0)]
    assert second.text == "seen 1" and len(second.completion_ids) == 5  # "stop" + EOS
    assert second.env_reward == 0.25 and second.finish_reason == "stop"
    assert failed.env_reward is None and failed.env_error == "env: step raised KeyError: 'no such state'"


def test_the_models_positions_end_an_episode_with_length_and_no_turn_passes_them() -> None:
    prompt = _prompt("q", "?")
    n_call = len(TOK(CALL, add_special_tokens=False)["input_ids"])
    limit = len(prompt.input_ids) + n_call + 30  # the call, its observation, then a few tokens
    runner, gen = _runner({"q": [CALL, "4" * 200]}, lambda: ToolEnv({"calculator": calculator}), max_positions=limit)
    [r] = runner.generate([prompt], SamplingParams(n=1, max_new_tokens=200))
    assert len(prompt.input_ids) + len(r.completion_ids) == limit and r.finish_reason == "length"
    # every call asked for no more new tokens than its context left positions for
    assert [len(c) + p.max_new_tokens for c, p in zip(gen.contexts, gen.params)] == [limit, limit]
    assert r.turns[-1]["role"] == "assistant" and r.loss_mask[-1] == 1.0


def test_only_an_episode_near_the_positions_gets_a_shorter_turn_of_its_own() -> None:
    near, far = _prompt("near", "x" * 40), _prompt("far", "?")
    limit = len(near.input_ids) + 12
    runner, gen = _runner({"near": ["7" * 50], "far": ["8" * 50]}, lambda: ToolEnv({"calculator": calculator}), max_turns=1,
                          max_positions=limit)
    a, b = runner.generate([near, far], SamplingParams(n=1, max_new_tokens=20))
    assert len(a.completion_ids) == 12 and a.finish_reason == "length"
    assert len(b.completion_ids) == 20  # its turn as asked, not cut to its neighbour's room
    assert sorted(p.max_new_tokens for p in gen.params) == [12, 20]


def test_an_observation_that_fills_the_positions_ends_the_episode() -> None:
    prompt = _prompt("q", "?")
    n_call = len(TOK(CALL, add_special_tokens=False)["input_ids"])
    limit = len(prompt.input_ids) + n_call + 3  # the observation's markers alone take more
    runner, gen = _runner({"q": [CALL, "42"]}, lambda: ToolEnv({"calculator": calculator}), max_positions=limit)
    [r] = runner.generate([prompt], SamplingParams(n=1, max_new_tokens=100))
    assert len(r.completion_ids) == n_call and r.finish_reason == "length" and len(gen.contexts) == 1


def test_the_token_budget_ends_an_episode_with_length() -> None:
    runner, _ = _runner({"q": [CALL, "42"]}, lambda: ToolEnv({"calculator": calculator}), max_total_tokens=60)
    [r] = runner.generate([_prompt("q", "?")], SamplingParams(n=1, max_new_tokens=200))
    assert len(r.completion_ids) == 60 and r.finish_reason == "length"
    assert r.loss_mask.tolist() == [1.0] * 60


def test_a_first_observation_replaces_the_prompt() -> None:
    class Greeter:
        def reset(self, prompt):
            return "Find the code."

        def step(self, action):
            return StepResult(done=True, reward=1.0)

    runner, gen = _runner({"q": ["ok"]}, Greeter)
    [r] = runner.generate([_prompt("q", "ignored")], SamplingParams(n=1, max_new_tokens=10))
    assert TOK.decode(gen.contexts[0]) == "<|im_start|>user\nFind the code.<|im_end|>\n<|im_start|>assistant\n"
    assert r.prompt_ids.tolist() == gen.contexts[0] and r.env_reward == 1.0


def test_the_plain_format_without_a_chat_template() -> None:
    glue = turn_glue(TOK, use_chat_template=False)
    assert glue.observation_text("7", ended_turn=True) == "\ntool: 7\nassistant: "
    assert glue.observation_text("7", ended_turn=False) == "<|im_end|>\ntool: 7\nassistant: "


# -- return values of the wrong kind: the episode fails like a raise, the run goes on --------


def _bad_env(reset_value=None, **step_fields):
    """An environment that misbehaves on prompt "bad" only: its ``reset`` returns
    ``reset_value`` and its ``step`` a StepResult with ``step_fields``; on any other
    prompt it keeps the prompt and ends the episode with reward 1.0."""

    class Env:
        def reset(self, prompt):
            self.bad = prompt.id == "bad"
            return reset_value if self.bad else None

        def step(self, action):
            return StepResult(**step_fields) if self.bad else StepResult(reward=1.0, done=True)

    return Env


@pytest.mark.parametrize(
    ("make_env", "error"),
    [
        (_bad_env(reward=None), "env: step returned reward None (expected a finite number)"),
        (_bad_env(reward=float("nan")), "env: step returned reward float nan (expected a finite number)"),
        (_bad_env(reward="1"), "env: step returned reward str '1' (expected a finite number)"),
        (_bad_env(observation=42), "env: step returned observation int 42 (expected a str or None)"),
        (_bad_env(observation=42, done=True), "env: step returned observation int 42 (expected a str or None)"),
        (_bad_env(reset_value=42), "env: reset returned int 42 (expected a str or None)"),
        # "no" is truthy: it used to end the episode as if done were True
        (_bad_env(observation="o", done="no"), "env: step returned done str 'no' (expected a bool)"),
        (_bad_env(done=2), "env: step returned done int 2 (expected a bool)"),
        (_bad_env(observation="z" * (MAX_OBSERVATION_CHARS + 1), done=True),
         f"env: step returned an answer of {MAX_OBSERVATION_CHARS + 1:,} characters, more than the "
         f"{MAX_OBSERVATION_CHARS:,} an observation may have; cut it in the environment"),
        (_bad_env(reset_value="w" * (MAX_OBSERVATION_CHARS + 1)),
         f"env: reset text too long: {MAX_OBSERVATION_CHARS + 1:,} characters, more than the "
         f"{MAX_OBSERVATION_CHARS:,} an observation may have; shorten what reset returns"),
    ],
    ids=["reward-none", "reward-nan", "reward-str", "observation-int", "answer-int", "reset-int",
         "done-str", "done-int", "answer-huge", "reset-huge"],
)
def test_a_return_value_of_the_wrong_kind_fails_only_its_episode(make_env, error) -> None:
    from rltune.rewards.results import fill
    from rltune.runtime.experience import episode_metrics

    runner, gen = _runner({"good": ["go"], "bad": ["go"]}, make_env)
    good, bad = runner.generate([_prompt("good", "G"), _prompt("bad", "B")], SamplingParams(n=1, max_new_tokens=10))
    for r in (good, bad):
        fill(r, [], [])  # scored with the env reward alone
    assert bad.env_error == error and bad.env_reward is None
    assert bad.reward is None and bad.reward_error == error and bad.rewards == {"env": None}
    assert episode_metrics([good, bad])["env/errors"] == 1.0
    # the turn the model took before the bad step is kept (none when reset failed)
    played = [] if "reset" in error else [("assistant", "go")]
    assert [(t["role"], t["content"]) for t in bad.turns] == played
    assert bad.text == ("" if "reset" in error else "go")
    assert len(bad.completion_ids) == (0 if "reset" in error else 3)  # "g", "o", EOS
    # the other episode of the batch is scored as if nothing happened
    assert good.env_error is None and good.env_reward == 1.0 and good.reward == 1.0
    assert good.reward_error is None and good.finish_reason == "stop"
    assert len(gen.contexts) == (1 if "reset" in error else 2)  # no turn for a failed reset


def test_rewards_are_finite_real_numbers_as_for_reward_functions() -> None:
    # a bool and a numpy number are real numbers (as rltune.rewards.calls.checked has it)
    runner, _ = _runner({"bad": ["go", "go"]}, _bad_env(reward=True), max_turns=2)
    [r] = runner.generate([_prompt("bad", "B")], SamplingParams(n=1, max_new_tokens=10))
    assert r.env_error is None and r.env_reward == 2.0 and type(r.env_reward) is float
    runner, _ = _runner({"bad": ["go"]}, _bad_env(reward=np.float32(0.5), done=True))
    [r] = runner.generate([_prompt("bad", "B")], SamplingParams(n=1, max_new_tokens=10))
    assert r.env_error is None and r.env_reward == 0.5
    # an int too large for a float is not finite; nor is a sum of finite rewards that overflows
    runner, _ = _runner({"bad": ["go"]}, _bad_env(reward=10**400))
    [r] = runner.generate([_prompt("bad", "B")], SamplingParams(n=1, max_new_tokens=10))
    assert r.env_reward is None and r.env_error.startswith("env: step returned reward int 1000")
    assert r.env_error.endswith(f"... (expected a finite number within {F32})") and len(r.env_error) < 250
    runner, _ = _runner({"bad": ["go", "go"]}, _bad_env(reward=3e38), max_turns=2)
    [r] = runner.generate([_prompt("bad", "B")], SamplingParams(n=1, max_new_tokens=10))
    assert r.env_reward is None and r.env_error == f"env: step rewards add up to 6e+38 (expected a finite number within {F32})"
    # one step's reward past float32's range, where training reads it
    runner, _ = _runner({"bad": ["go"]}, _bad_env(reward=1e300))
    [r] = runner.generate([_prompt("bad", "B")], SamplingParams(n=1, max_new_tokens=10))
    assert r.env_reward is None and r.env_error == f"env: step returned reward float 1e+300 (expected a finite number within {F32})"


F32 = "float32's range, where training reads rewards: |r| <= 3.4e38"


def test_a_numpy_bool_is_a_bool() -> None:
    runner, _ = _runner({"bad": ["go"]}, _bad_env(reward=1.0, done=np.True_))
    [r] = runner.generate([_prompt("bad", "B")], SamplingParams(n=1, max_new_tokens=10))
    assert r.env_error is None and r.env_reward == 1.0 and r.finish_reason == "stop"


class _Spy:
    """The tiny tokenizer, recording the length of every text it is asked to tokenise."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def __call__(self, text, **kw):
        self.lengths.append(len(text))
        return TOK(text, **kw)

    def decode(self, *args, **kw):
        return TOK.decode(*args, **kw)


def test_observations_are_bounded_by_characters_before_they_are_tokenised() -> None:
    # a 4 MB answer used to be kept whole (the completion and a turn of samples.jsonl,
    # twice per sample), and a 4 MB tool turn tokenised in full before the room check
    huge = "z " * 2_000_000
    for fields in ({"observation": huge}, {"observation": huge, "done": True}):
        gen = Scripted({"bad": ["go"]})
        spy = _Spy()
        runner = EpisodeGenerator(gen, spy, _bad_env(**fields), glue=turn_glue(TOK),
                                  encode=lambda p: encode_prompt(TOK, p), max_turns=2,
                                  max_total_tokens=400, eos_ids=[EOS])
        [r] = runner.generate([_prompt("bad", "B")], SamplingParams(n=1, max_new_tokens=10))
        if fields.get("done"):  # an answer is scored as it is: too long to keep, an error
            assert r.env_error.startswith("env: step returned an answer of 4,000,000 characters")
        else:  # between turns: past any room, the episode ends on its budget, scored
            assert r.env_error is None and r.finish_reason == "length"
        assert r.text == "go" and [t["content"] for t in r.turns] == ["go"]  # nothing of it kept
        assert all(n <= MAX_OBSERVATION_CHARS for n in spy.lengths)
    # at the bound exactly, an observation is shown (the room check decides what fits)
    runner, _ = _runner({"bad": ["go", "go"]}, _bad_env(observation="z" * MAX_OBSERVATION_CHARS), max_turns=2)
    [r] = runner.generate([_prompt("bad", "B")], SamplingParams(n=1, max_new_tokens=10))
    assert r.env_error is None and r.finish_reason == "length"


def test_a_factory_that_raises_fails_only_its_episode() -> None:
    # the factory is called once per episode; one that raises mid-run (a game server out of
    # reach) used to end the run with a traceback
    made = []

    def make():
        made.append(1)
        if len(made) == 2:
            raise RuntimeError("server unreachable")
        return ToolEnv({"calculator": calculator})

    runner, gen = _runner({"a": ["6", "7"]}, make)
    first, second = runner.generate([_prompt("a", "A")], SamplingParams(n=2, max_new_tokens=10))
    assert first.env_error is None and first.text == "6"
    assert second.env_error == "env: factory raised RuntimeError: server unreachable"
    assert second.env_reward is None and second.completion_ids.numel() == 0 and second.turns == []
    assert len(gen.contexts) == 1  # no turn generated for it


def test_reset_gets_a_copy_the_dataset_does_not_see() -> None:
    # an environment that changes the prompt it is given (its meta lists and dicts) used
    # to change the dataset for the later samples of the group and for later epochs
    seen = []

    class Mutating:
        def reset(self, prompt):
            seen.append((list(prompt.meta["tests"]), dict(prompt.meta["info"])))
            prompt.meta["tests"].pop()
            prompt.meta["info"]["level"] += 1
            prompt.meta["answer"] = "999"
            prompt.input_ids.append(0)
            prompt.messages[0]["content"] = "changed"
            return None

        def step(self, action):
            return StepResult(done=True)

    prompt = Prompt(id="a", messages=[{"role": "user", "content": "A"}],
                    meta={"tests": ["t1", "t2"], "info": {"level": 1}, "answer": "4"})
    prompt.input_ids = encode_prompt(TOK, prompt)
    ids = list(prompt.input_ids)
    runner, _ = _runner({"a": ["x"] * 3}, Mutating)
    runner.generate([prompt], SamplingParams(n=3, max_new_tokens=10))
    assert seen == [(["t1", "t2"], {"level": 1})] * 3
    assert prompt.meta == {"tests": ["t1", "t2"], "info": {"level": 1}, "answer": "4"}
    assert prompt.input_ids == ids and prompt.messages == [{"role": "user", "content": "A"}]


@pytest.mark.parametrize("done", [None, 0, 1, False, np.bool_(True)])
def test_done_may_be_none_or_a_zero_or_one_as_it_always_could(done) -> None:
    runner, _ = _runner({"bad": ["go", "go"]}, _bad_env(observation="o", done=done), max_turns=2)
    [r] = runner.generate([_prompt("bad", "B")], SamplingParams(n=1, max_new_tokens=10))
    assert r.env_error is None
    assert r.finish_reason == ("stop" if done else "length")  # ended by done, or by the turns


def test_a_prompt_that_cannot_be_copied_is_named_as_such_not_as_resets_failure() -> None:
    import threading as _threading

    runner, gen = _runner({"q": ["go"]}, lambda: ToolEnv({"calculator": calculator}), max_turns=1)
    prompt = _prompt("q", "?")
    prompt.meta["lock"] = _threading.Lock()
    [r] = runner.generate([prompt], SamplingParams(n=1, max_new_tokens=8))
    assert r.env_error.startswith("env: cannot copy prompt 'q' for reset: TypeError: ")
    assert gen.contexts == []  # never generated on
