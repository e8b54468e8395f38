"""DAPO's dynamic sampling, checked by what the learner gets: groups whose rewards are all
equal are dropped and replaced by refill rounds, so every group learned on has spread.

The reward makes half the prompts carry no signal by construction: a prompt whose first
operand starts with an even digit scores 0 whatever the completion, the others score the
completion's share of digits (which differs between the samples of a group). So about
half of each step's first draw is dropped, and the step must refill to reach
``train.prompts_per_step`` groups.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rltune.runtime.local import build_run
from rltune.runtime.loop import train

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

HALF_SIGNAL_REWARD = '''
def half_signal(prompt, completion, **meta):
    """0 for a prompt starting with an even digit; else the completion's digit share."""
    if int(prompt.text[0]) % 2 == 0 or not completion:
        return 0.0
    return sum(ch.isdigit() for ch in completion) / len(completion)
'''
GROUP, PROMPTS, STEPS = 8, 8, 3


def test_refill_rounds_run_and_every_learned_group_has_spread(
        tiny_grpo_config, tmp_path: Path) -> None:
    reward_file = tmp_path / "half_signal.py"
    reward_file.write_text(HALF_SIGNAL_REWARD)
    cfg = tiny_grpo_config(
        "algo.name=dapo", f"algo.group_size={GROUP}", f"train.prompts_per_step={PROMPTS}",
        f"train.steps={STEPS}", "train.threads=1", "algo.max_refill_rounds=4",
        f"reward.0.fn={reward_file}:half_signal")
    run = build_run(cfg)
    history = train(run)

    rounds = [m["groups/refill_rounds"] for m in history]
    kept = [m["groups/kept_frac"] for m in history]
    # Half the prompts are dropped by construction, so each step's first draw of 8 keeps 8
    # groups only if all 8 start with an odd digit (1 in 256): every step refills.
    assert all(1 <= r <= 4 for r in rounds), rounds
    assert all(0.2 < k < 0.8 for k in kept), kept

    samples = [json.loads(line) for line in (run.run_dir / "samples.jsonl").open()]
    assert [s["step"] for s in samples] == sorted(s["step"] for s in samples)
    for step, metrics in enumerate(history, start=1):
        learned = [s for s in samples if s["step"] == step]
        # the learner's batch is the samples written: its size, from the step's throughput
        # (samples_per_s = len(batch) / time/step; float round-off only)
        assert round(metrics["samples_per_s"] * metrics["time/step"]) == len(learned)
        # whole groups, at most train.prompts_per_step of them (fewer where the refill
        # rounds ran out: an odd prompt's group with no digit at all has no spread either)
        assert len(learned) % GROUP == 0 and 0 < len(learned) <= GROUP * PROMPTS, len(learned)
        assert all(int(s["prompt"][0]) % 2 == 1 for s in learned), \
            sorted({s["prompt"] for s in learned if int(s["prompt"][0]) % 2 == 0})
        for g in range(0, len(learned), GROUP):
            group = learned[g:g + GROUP]
            assert len({s["prompt_id"] for s in group}) == 1, (step, g)
            rewards = [s["reward"] for s in group]
            assert max(rewards) > min(rewards), (step, g, rewards)


def test_a_step_whose_every_group_is_dropped_learns_nothing_and_says_so(
        tiny_grpo_config, tmp_path: Path) -> None:
    """A reward that never varies within a group (every prompt already solved, or none
    solvable) leaves DAPO nothing to learn on after its refill rounds: the step is empty,
    reported as ``learn/empty_batch``, and the run goes on with its weights unchanged."""
    reward_file = tmp_path / "flat.py"
    reward_file.write_text("def flat(prompt, completion, **meta):\n    return 1.0\n")
    cfg = tiny_grpo_config(
        "algo.name=dapo", "algo.group_size=4", "train.prompts_per_step=2", "train.steps=2",
        "train.threads=1", "algo.max_refill_rounds=1", "rollout.max_new_tokens=4",
        f"reward.0.fn={reward_file}:flat")
    run = build_run(cfg)
    before = {k: v.clone() for k, v in run.roles.learner.model.state_dict().items()}
    history = train(run)

    assert [m["learn/empty_batch"] for m in history] == [1.0, 1.0]
    assert [m["groups/kept_frac"] for m in history] == [0.0, 0.0]
    assert [m["groups/refill_rounds"] for m in history] == [1.0, 1.0]
    after = run.roles.learner.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
