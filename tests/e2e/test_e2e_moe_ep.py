"""``rltune train`` of GRPO on ``builtin:tiny-moe`` with its experts split over two learner
ranks on Ray (``runtime.placement.learners: 2``, ``train.parallel.ep: 2``): the reward
rises where the same run at lr 0 stays flat, and the first step (the same samples as a
one-process run: one generator, the same seed and weights) has the one-process run's
loss, gradient norm and expert load.

Slow: each run starts a local Ray and three actors (~1.5 min on two cores)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray", reason="the ray extra is not installed")

from rltune.cli import main  # noqa: E402

pytestmark = pytest.mark.slow

REWARD = '''
def digit_share(prompt, completion, **meta):
    """Share of the completion's characters that are digits."""
    if not completion:
        return 0.0
    return sum(ch.isdigit() for ch in completion) / len(completion)
'''
EP = ("runtime.mode=ray", "runtime.placement.learners=2", "train.parallel.ep=2")
LOAD_KEYS = ("moe/load_max", "moe/load_min", "moe/load/e0", "moe/load/e1", "moe/load/e2", "moe/load/e3")


@pytest.fixture(scope="module")
def train_run(tmp_path_factory: pytest.TempPathFactory):
    """``run(name, *overrides) -> metrics``: ``rltune train`` of the module's config; each
    step's metrics, read back from the run's metrics.jsonl."""
    root = tmp_path_factory.mktemp("moe-ep")
    (root / "rewards.py").write_text(REWARD)
    config = {
        "name": "moe-ep",
        "model": {"path": "builtin:tiny-moe"},
        "algo": {"name": "grpo", "group_size": 8},
        "data": {"train": "builtin:arith_small/train"},
        "reward": [{"fn": "rewards.py:digit_share"}],
        "rollout": {"max_new_tokens": 8},
        "train": {"steps": 30, "prompts_per_step": 8, "lr": 1e-3, "threads": 1},
        "log": {"dir": str(root / "runs"), "console": False},
        "checkpoint": {"final": False},
    }
    path = root / "moe-ep.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))

    def run(name: str, *overrides: str) -> list[dict]:
        assert main(["train", str(path), f"name={name}", *overrides]) == 0
        lines = (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    return run


def _ends(metrics: list[dict]) -> tuple[float, float]:
    curve = [m["reward/mean"] for m in metrics]
    return statistics.mean(curve[:5]), statistics.mean(curve[-5:])


def test_grpo_at_ep2_raises_the_reward_and_lr0_does_not(train_run) -> None:
    learned = train_run("ep2", *EP)
    control = train_run("ep2-lr0", *EP, "train.lr=0")
    first, last = _ends(learned)
    # one process on this config: 0.06 over the first five steps, 0.62 over the last five
    assert first < 0.3 and last > first + 0.3, [m["reward/mean"] for m in learned]
    c_first, c_last = _ends(control)
    assert abs(c_last - c_first) < 0.08, [m["reward/mean"] for m in control]
    assert last > c_last + 0.3


def test_first_step_at_ep2_is_one_process_step(train_run) -> None:
    # the same prompts and samples (one generator, seed and weights alike): the reward is
    # the same to the bit; the learner's sums over the ranks differ from one process's by
    # fp32 rounding only (rel 1e-5, as in tests/distributed/test_layouts_ep.py), and the
    # routing counts are integers summed over the ranks (load shares to 1e-6). The router's
    # balance loss is off: in any data-parallel group each rank's is its own rows' (a
    # product of per-batch fractions, not additive over rows), as with ddp and fsdp2
    step = ("train.steps=1", "model.router_aux_loss_coef=0")
    one = train_run("one", *step)[0]
    ep2 = train_run("ep2-one", *EP, *step)[0]
    assert ep2["reward/mean"] == one["reward/mean"]
    # the first on-policy GRPO loss is ~0 (advantages centred per group, ratio 1): a sum
    # of O(1e-1) terms whose fp32 rounding is ~1e-8, so it compares absolutely
    assert ep2["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert ep2["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for key in LOAD_KEYS:
        assert ep2[key] == pytest.approx(one[key], abs=1e-6), key
    # the generator's expert load: the same samples, counted on the generator actor on
    # Ray and in the process locally; integer counts, so equal exactly
    generated = [k for k, v in one.items() if k.startswith("gen/moe/") and isinstance(v, float)]
    assert generated and all(ep2.get(k) == one[k] for k in generated), {k: (one[k], ep2.get(k)) for k in generated}
