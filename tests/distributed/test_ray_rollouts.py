"""Generator and scorer actors on a local Ray (``rltune/runtime/ray/rollouts.py``): they
give what the in-process generator and scorer give, and an actor killed with SIGKILL, between
calls or during one, is replaced and its share reissued: every prompt is generated and
scored exactly once, and the replacement generates with the newest weights."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from rltune.config import load_config  # noqa: E402
from rltune.config.schema import PlacementConfig  # noqa: E402
from rltune.data.records import Prompt, SamplingParams  # noqa: E402
from rltune.models.load import load_model, load_tokenizer  # noqa: E402
from rltune.rewards.scorer import LocalScorer, ScoreStats, build_reward_fns  # noqa: E402
from rltune.rollout.hf import HFGenerator  # noqa: E402
from rltune.runtime.ray.cluster import RayRuntimeError, place  # noqa: E402
from rltune.runtime.ray.rollouts import RayGenerator, RayScorer  # noqa: E402


def by_fn(stats: ScoreStats, field: str) -> dict[str, float]:
    """One statistic of each reward function, as plain numbers."""
    return {name: getattr(fn, field).value for name, fn in stats.per_fn.items()}


REWARDS = '''
import time

def digit_share(prompt, completion, **meta):
    if "slow" in prompt.text:
        time.sleep(1.0)
    if "bad" in prompt.text:
        raise ValueError("no reward for this one")
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))
'''


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory, model_dir: str):
    root = tmp_path_factory.mktemp("ray-rollouts")
    (root / "rewards.py").write_text(REWARDS)
    return load_config(None, [
        f"model.path={model_dir}", "data.train=builtin:arith_small/train",
        f"reward.0.fn={root / 'rewards.py'}:digit_share", "runtime.mode=ray",
        "runtime.actor_restarts=2", "train.seed=7", f"log.dir={root / 'runs'}",
    ])


@pytest.fixture(scope="module")
def placement(ray_cluster):
    p = place(PlacementConfig(generators=2, scorers=2, learners=1), name="test-rollouts")
    yield p
    p.remove()


@pytest.fixture(scope="module")
def generator(cfg, model_dir, placement, tmp_path_factory):
    gen = RayGenerator(cfg, model_dir, None, placement, tmp_path_factory.mktemp("faults") / "faults.jsonl")
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def scorer(cfg, placement):
    s = RayScorer(cfg, None, placement, None)
    yield s
    s.close()


def prompts(model_dir: str, n: int, text: str = "12+34=") -> list[Prompt]:
    tok = load_tokenizer(model_dir)
    return [Prompt(id=f"{text}{i}", text=f"{text}{i}", input_ids=tok(f"{text}{i}")["input_ids"]) for i in range(n)]


PARAMS = SamplingParams(n=2, max_new_tokens=6, temperature=1.0)


def test_two_actors_generate_each_prompt_once_in_order(generator, model_dir) -> None:
    ps = prompts(model_dir, 5)
    out = generator.generate(ps, PARAMS, group_offset=10)
    assert [r.prompt_id for r in out] == [p.id for p in ps for _ in range(2)]
    assert [r.group for r in out] == [10 + i for i in range(5) for _ in range(2)]
    assert all(r.completion_logprobs is not None and len(r.completion_ids) > 0 for r in out)


def test_one_actor_samples_as_the_local_generator(cfg, model_dir, placement) -> None:
    """Actor 0 seeds its stream with ``train.seed``, as the local runtime does: the same
    prompts give the same tokens and log-probs."""
    ps = prompts(model_dir, 3)
    one = place_one_generator()
    gen = RayGenerator(cfg, model_dir, None, one, None)
    try:
        remote = gen.generate(ps, PARAMS)
    finally:
        gen.close()
        one.remove()
    torch.set_num_threads(1)
    local = HFGenerator(load_model(model_dir).eval(), load_tokenizer(model_dir),
                        rng=torch.Generator().manual_seed(cfg.train.seed)).generate(ps, PARAMS)
    for a, b in zip(remote, local, strict=True):
        assert torch.equal(a.completion_ids, b.completion_ids)
        torch.testing.assert_close(a.completion_logprobs, b.completion_logprobs, rtol=0, atol=1e-5)


def place_one_generator():
    return place(PlacementConfig(generators=1, scorers=1, learners=1), name="test-one-generator")


def test_new_weights_reach_every_actor_and_a_replacement(generator, model_dir) -> None:
    model = load_model(model_dir)
    weights = {k: torch.zeros_like(v) if k.endswith("lm_head.weight") else v for k, v in model.state_dict().items()}
    generator.load_weights(5, weights)
    before = generator.generate(prompts(model_dir, 4), PARAMS)
    assert {r.policy_version for r in before} == {5}
    kill(generator.pool, 1)
    after = generator.generate(prompts(model_dir, 4), PARAMS)
    assert [r.prompt_id for r in after] == [r.prompt_id for r in before]
    # the replacement was given version 5's weights before its reissued call
    assert {r.policy_version for r in after} == {5}
    # a zero lm_head samples uniformly: the replacement's log-probs are log(1/V) too
    vocab = model.config.vocab_size
    for r in after:
        torch.testing.assert_close(r.completion_logprobs, torch.full_like(r.completion_logprobs, -torch.log(torch.tensor(float(vocab)))))
    assert generator.step_metrics()["faults/generator_restarts"].value == 1.0
    faults = [json.loads(line) for line in generator.pool.faults_file.read_text().splitlines()]
    assert faults[-1]["role"] == "generator" and faults[-1]["actor"] == 1


def test_an_actor_killed_during_a_call_has_its_prompts_reissued_once(generator, model_dir) -> None:
    long = SamplingParams(n=16, max_new_tokens=128, temperature=1.0)  # ~1 s per actor
    ps = prompts(model_dir, 6)
    out = call_while_killing(lambda: generator.generate(ps, long), generator.pool, 0, after_s=0.3)
    assert [r.prompt_id for r in out] == [p.id for p in ps for _ in range(16)]
    assert [r.group for r in out] == [i for i in range(6) for _ in range(16)]
    assert generator.step_metrics()["faults/generator_restarts"].value == 1.0


def test_scorer_actors_score_as_the_local_scorer(scorer, cfg, model_dir, generator) -> None:
    ps = prompts(model_dir, 3) + prompts(model_dir, 2, text="bad ")
    rollouts = generator.generate(ps, PARAMS)
    stats = scorer.score({p.id: p for p in ps}, rollouts)
    local = LocalScorer(build_reward_fns(cfg.reward))
    expected = [r for r in generator.generate(ps, PARAMS)]  # fresh rollouts to score locally
    for mine, theirs in zip(expected, rollouts):
        mine.text = theirs.text
    with local:
        want = local.score({p.id: p for p in ps}, expected)
    assert [r.reward for r in rollouts] == [r.reward for r in expected]
    assert [r.reward_error for r in rollouts] == [r.reward_error for r in expected], rollouts[0].reward_error
    assert stats.errors.value == want.errors.value == 4, rollouts[0].reward_error
    assert by_fn(stats, "errors") == by_fn(want, "errors")
    assert by_fn(stats, "mean")["digit_share"] == pytest.approx(by_fn(want, "mean")["digit_share"], abs=1e-12)
    assert scorer.accuracy_names == ()


def test_a_scorer_killed_during_a_call_scores_every_sample_once(scorer, model_dir, generator) -> None:
    ps = prompts(model_dir, 4, text="slow ")
    rollouts = generator.generate(ps, PARAMS)
    stats = call_while_killing(lambda: scorer.score({p.id: p for p in ps}, rollouts), scorer.pool, 1, after_s=0.5)
    assert all(r.reward is not None for r in rollouts)
    assert stats.errors.value == 0 and sum(by_fn(stats, "calls").values()) == len(rollouts)
    assert scorer.step_metrics()["faults/scorer_restarts"].value == 1.0


def test_used_up_restarts_fail_the_run_with_the_cause(generator, model_dir) -> None:
    """Last in this file: it leaves the module's generator pool with a dead actor."""
    generator.pool.restarts_left = 0
    kill(generator.pool, 0)
    with pytest.raises(RayRuntimeError, match="generator actor 0 died and runtime.actor_restarts is used up"):
        generator.generate(prompts(model_dir, 2), PARAMS)


def call_while_killing(call, pool, i: int, *, after_s: float):
    """``call()`` in a thread; actor ``i`` of ``pool`` is SIGKILLed ``after_s`` seconds in,
    and the call must still have been running then (else the test would prove nothing)."""
    pid = ray.get(pool.actors[i].pid.remote())
    result: list = []
    worker = threading.Thread(target=lambda: result.append(call()))
    worker.start()
    time.sleep(after_s)
    assert worker.is_alive(), "the call ended before the kill; give it more work"
    os.kill(pid, signal.SIGKILL)
    worker.join(timeout=120)
    assert result, "the call did not return"
    return result[0]


def kill(pool, i: int) -> None:
    """SIGKILL actor ``i``'s process, as the kernel's OOM killer or a lost node would."""
    os.kill(ray.get(pool.actors[i].pid.remote()), signal.SIGKILL)
