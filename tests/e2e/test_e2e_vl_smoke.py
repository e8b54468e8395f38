"""builtin:tiny-vl (a tiny Qwen2-VL) trains with each kind of algorithm on a jsonl of PNG
prompts: GRPO (generator with pixel inputs, learner log-probs with the same: no
mismatch), PPO (a vision-language critic), SFT and DPO (reference log-probs with images) run two steps each to finite
losses; the language model moves while the frozen vision tower stays; and a GRPO run
generating one step ahead (rollouts with pixel inputs queued in its checkpoint) resumes
exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from rltune.config import load_config
from rltune.runtime.local import build_run
from rltune.runtime.loop import train

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

REWARD = '''
def lowercase_share(prompt, completion, **meta):
    """Share of lowercase ASCII letters: dense, so an untrained model's groups differ."""
    return sum("a" <= ch <= "z" for ch in completion) / len(completion) if completion else 0.0
'''
SHAPES = {"red": ((220, 30, 30), (112, 112)), "blue": ((30, 30, 220), (140, 112)),
          "green": ((30, 180, 30), (112, 168)), "black": ((0, 0, 0), (84, 84))}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Four PNGs of a filled circle in different sizes (16 to 30 image tokens), each row a
    question with its answer, an SFT completion and a preference pair."""
    root = tmp_path_factory.mktemp("vl_data")
    (root / "imgs").mkdir()
    rows = []
    for name, (rgb, size) in SHAPES.items():
        image = Image.new("RGB", size, (128, 128, 128))
        ImageDraw.Draw(image).ellipse((10, 10, size[0] - 10, size[1] - 10), fill=rgb)
        image.save(root / "imgs" / f"{name}.png")
        prompt = [{"role": "user", "content": [{"type": "image", "image": f"imgs/{name}.png"},
                                               {"type": "text", "text": "Colour?"}]}]
        rows.append({"prompt": prompt, "answer": name, "completion": name,
                     "chosen": name, "rejected": "grey"})
    path = root / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(REWARD)
    return path


def _reward(data: Path) -> str:
    return f"reward.0.fn={data.parent / 'rewards.py'}:lowercase_share"


def _config(root: Path, name: str, data: Path, *extra: str):
    return load_config(None, [
        f"name={name}", "model.path=builtin:tiny-vl", f"data.train={data}",
        "train.steps=2", "train.prompts_per_step=2", "train.lr=1e-2", "train.threads=1",
        "rollout.max_new_tokens=4", "checkpoint.final=false",
        f"log.dir={root}", "log.console=false", *extra,
    ])


TIMING = ("samples_per_s", "tokens_per_s", "async/learner_idle_frac", "async/generator_idle_frac")


def _deterministic(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "perf/")) and k not in TIMING}


def _losses(history: list[dict]) -> list[float]:
    return [m["loss"] for m in history if "loss" in m]


def _moved(run, before: dict[str, torch.Tensor]) -> tuple[bool, bool]:
    """(the language model moved, the vision tower moved)."""
    after = run.learner.model.state_dict()
    moved = {k for k, v in after.items() if not torch.equal(v, before[k])}
    return any(".language_model." in k for k in moved), any(".visual." in k for k in moved)


@pytest.mark.parametrize("algo, extra", [
    ("grpo", ["algo.group_size=3", "REWARD"]),
    ("ppo", ["algo.group_size=2", "REWARD"]),  # the critic takes the pixel inputs too
    ("sft", []),
    ("dpo", ["algo.beta=0.1"]),
])
def test_two_steps_on_images(tmp_path, dataset, algo, extra) -> None:
    extra = [_reward(dataset) if x == "REWARD" else x for x in extra]
    run = build_run(_config(tmp_path, f"vl-{algo}", dataset, f"algo.name={algo}", *extra))
    before = {k: v.clone() for k, v in run.learner.model.state_dict().items()}
    history = train(run)
    losses = _losses(history)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    if algo in ("grpo", "ppo"):  # the learner's log-probs of the samples are the generator's
        assert all(m["logprob_mismatch"] < 1e-5 for m in history), [m["logprob_mismatch"] for m in history]
    assert _moved(run, before) == (True, False)  # model.freeze_vision: the tower stays
    if run.roles.critic is not None:  # PPO's critic keeps its tower frozen too
        assert not any(p.requires_grad for p in run.roles.critic.model.body.visual.parameters())


def test_grpo_one_step_ahead_resumes_exactly(tmp_path, dataset) -> None:
    extra = ("algo.name=grpo", "algo.group_size=3", _reward(dataset), "train.steps=4", "runtime.max_staleness=1",
             "algo.importance_correction=token-truncate", "checkpoint.every=2", "checkpoint.resume=auto")
    straight = build_run(_config(tmp_path / "a", "vl-resume", dataset, *extra))
    a = train(straight)
    cfg = _config(tmp_path / "b", "vl-resume", dataset, *extra)
    first = train(build_run(cfg), stop_after=2)
    resumed = build_run(cfg)
    second = train(resumed)
    assert len(first) == len(second) == 2  # it resumed, it did not start over
    b = first + second
    for step, (x, y) in enumerate(zip(a, b), 1):
        x, y = _deterministic(x), _deterministic(y)
        assert x == y, (step, {k: (x.get(k), y.get(k)) for k in x.keys() | y.keys() if x.get(k) != y.get(k)})
    sa, sb = straight.learner.model.state_dict(), resumed.learner.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
