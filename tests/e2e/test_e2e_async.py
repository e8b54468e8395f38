"""Rollouts generated ahead of the learner (``runtime.max_staleness``) on the tiny model:
the run still learns, no sample is staler than the bound, and a run stopped mid-way and
resumed from its checkpoint learns on every prompt of the data order exactly once, even
though the producer had already drawn and generated the prompts of later steps."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict

from rltune.data.sampler import PromptSampler
from rltune.runtime.local import build_run
from rltune.runtime.loop import train

ASYNC = ("algo.importance_correction=token-truncate",)


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
    assert run.rollouts._queue, "the producer should have run ahead of the checkpoint"
    resumed = build_run(tiny_grpo_config(*overrides))
    train(resumed)
    learned = defaultdict(list)
    for line in (resumed.run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["prompt_id"] not in learned[row["step"]]:
            learned[row["step"]].append(row["prompt_id"])
    sampler = PromptSampler(len(resumed.train_prompts), seed=resumed.cfg.train.seed, shuffle=True)
    expected = {step: sorted(resumed.train_prompts[i].id for i in sampler.next_batch(per_step))
                for step in range(1, steps + 1)}
    assert {step: sorted(ids) for step, ids in learned.items()} == expected
