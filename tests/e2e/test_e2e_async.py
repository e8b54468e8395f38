"""Rollouts generated ahead of the learner (``runtime.max_staleness``) on the tiny model:
the run still learns, no sample is staler than the bound, a run stopped mid-way and
resumed from its checkpoint learns on every prompt of the data order exactly once, even
though the producer had already drawn and generated the prompts of later steps, and it is
the same run as one that did not stop: the checkpoint carries the batches generated and
not yet learned, with the sampler and the sampling RNG as they were after them."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict

import pytest

from rltune.checkpoint.store import latest_checkpoint, load_checkpoint
from rltune.data.sampler import PromptSampler
from rltune.metrics.jsonl import JsonlReader
from rltune.runtime.local import build_run
from rltune.runtime.loop import train

ASYNC = ("algo.importance_correction=token-truncate",)
TIMING = ("samples_per_s", "tokens_per_s", "async/learner_idle_frac", "async/generator_idle_frac")
"""Wall-clock metrics (with every ``time/*``): the only ones two runs may differ in."""


def test_grpo_ahead_of_the_learner_raises_the_reward(tiny_grpo_config) -> None:
    history = train(build_run(tiny_grpo_config(*ASYNC, "runtime.max_staleness=1")))
    curve = [m["reward/mean"] for m in history]
    first, last = statistics.mean(curve[:5]), statistics.mean(curve[-5:])
    assert first < 0.3 and last > first + 0.3, curve
    staleness = [m["staleness/max"] for m in history]
    assert max(staleness) == 1.0 and staleness.count(1.0) >= len(history) // 2, staleness
    assert all(m["async/dropped_stale"] == 0 for m in history)
    assert all(0.0 <= m["async/learner_idle_frac"] <= 1.0 for m in history)


def test_a_resumed_run_learns_every_prompt_once(tiny_grpo_config) -> None:
    steps, per_step = 6, 4
    overrides = (*ASYNC, "runtime.max_staleness=2", f"train.steps={steps}",
                 f"train.prompts_per_step={per_step}", "algo.group_size=2", "checkpoint.every=3",
                 "checkpoint.resume=auto", "data.shuffle=true")
    run = build_run(tiny_grpo_config(*overrides))
    train(run, stop_after=3)
    # the checkpoint carries the batches of steps 4 and 5, generated before the stop; the
    # resumed run learns them, then draws from where the producer left off
    _, meta = load_checkpoint(latest_checkpoint(run.run_dir / "checkpoints"))
    assert [len(batch["prompts"]) for batch in meta["queue"]] == [per_step, per_step]
    resumed = build_run(tiny_grpo_config(*overrides))
    train(resumed)
    learned = defaultdict(list)
    for _, row in JsonlReader(resumed.run_dir / "samples.jsonl"):
        if row["prompt_id"] not in learned[row["step"]]:
            learned[row["step"]].append(row["prompt_id"])
    sampler = PromptSampler(len(resumed.train_prompts), seed=resumed.cfg.train.seed, shuffle=True)
    expected = {step: sorted(resumed.train_prompts[i].id for i in sampler.next_batch(per_step))
                for step in range(1, steps + 1)}
    assert {step: sorted(ids) for step, ids in learned.items()} == expected


def _deterministic(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "perf/")) and k not in TIMING}


def _differing(a: dict[str, float], b: dict[str, float]) -> list[str]:
    """Names of the metrics that differ between ``a`` and ``b`` (NaN equals NaN)."""
    a, b = _deterministic(a), _deterministic(b)
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not (
        a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k]))))


@pytest.mark.usefixtures("keep_torch_threads")
@pytest.mark.parametrize("ahead", [1, 2])
def test_a_resumed_run_is_the_run_that_did_not_stop(tiny_grpo_config, ahead: int) -> None:
    """4 steps straight against 2, stop, resume to 4, ``ahead`` batches ahead of the
    learner: every step's metrics (timing aside) and every sample are identical, steps 3
    and 4 included, whose batches were generated before the stop. The evaluations (sampled,
    at every step) use the producer's generator and its RNG between batches, so the pauses
    are covered."""
    overrides = (*ASYNC, f"runtime.max_staleness={ahead}", "train.steps=4", "train.prompts_per_step=4",
                 "algo.group_size=4", "checkpoint.every=2", "checkpoint.resume=auto", "data.shuffle=true",
                 "data.eval=builtin:arith_small/eval", "eval.every=1", "eval.max_prompts=4",
                 "eval.temperature=1.0", "train.threads=1")
    straight = build_run(tiny_grpo_config(*overrides, "name=straight"))
    train(straight)
    train(build_run(tiny_grpo_config(*overrides, "name=stopped")), stop_after=2)
    resumed = build_run(tiny_grpo_config(*overrides, "name=stopped"))
    train(resumed)
    a = [json.loads(line) for line in (straight.run_dir / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in a] == [m["step"] for m in b]
    differing = {m["step"]: _differing(m, n) for m, n in zip(a, b)}
    assert not any(differing.values()), "; ".join(
        f"step {step}: {len(names)} differ ({', '.join(names)})" for step, names in differing.items() if names)
    assert max(m.get("staleness/max", 0.0) for m in a) == ahead  # the batches were generated ahead
    assert (straight.run_dir / "samples.jsonl").read_text() == (resumed.run_dir / "samples.jsonl").read_text()
