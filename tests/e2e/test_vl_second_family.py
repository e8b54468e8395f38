"""The vision-language seam is not Qwen-specific: a LLaVA model (CLIP tower, projector,
Qwen2 language model), given as a plain model directory, trains GRPO end to end on a
dataset of image prompts. Its vision tower and projector stay as loaded
(``model.freeze_vision``), its language model moves, and the exported model loads back
with its processor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from rltune.config import load_config
from rltune.metrics.jsonl import JsonlReader
from rltune.models.load import load_model, load_processor
from rltune.models.tiny_vl import TINY_VL_SPECS, build_tiny_vl
from rltune.runtime.local import run_local

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 180, 30)}
REWARD = '''
def lowercase_share(prompt, completion, **meta):
    """Share of the completion's characters that are lowercase ASCII letters: a dense
    signal, so the groups of an untrained model's random bytes have advantages."""
    return sum("a" <= ch <= "z" for ch in completion) / len(completion) if completion else 0.0
'''


def _dataset(root: Path) -> Path:
    """Three 70x60 PNGs of a filled circle, one per colour, and a jsonl of image prompts."""
    (root / "imgs").mkdir(parents=True)
    rows = []
    for name, rgb in COLOURS.items():
        image = Image.new("RGB", (70, 60), (128, 128, 128))
        ImageDraw.Draw(image).ellipse((15, 10, 55, 50), fill=rgb)
        image.save(root / "imgs" / f"{name}.png")
        rows.append({"prompt": [{"role": "user", "content": [
            {"type": "image", "image": f"imgs/{name}.png"},
            {"type": "text", "text": "Colour?"},
        ]}], "answer": name})
    path = root / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_llava_directory_trains_grpo_on_image_prompts(tmp_path: Path) -> None:
    model_dir = build_tiny_vl(tmp_path / "tiny-llava", seed=0, **TINY_VL_SPECS["tiny-llava"])
    (tmp_path / "rewards.py").write_text(REWARD)
    cfg = load_config(None, [
        "name=llava-grpo",
        f"model.path={model_dir}",
        "algo.name=grpo",
        "algo.group_size=4",
        f"data.train={_dataset(tmp_path / 'data')}",
        f"reward.0.fn={tmp_path / 'rewards.py'}:lowercase_share",
        "rollout.max_new_tokens=6",
        "train.steps=2",
        "train.prompts_per_step=3",
        "train.lr=1e-2",
        "train.threads=1",
        f"log.dir={tmp_path / 'runs'}",
        "log.console=false",
    ])
    run = run_local(cfg)
    steps = [m for m in run.progress.history if "reward/mean" in m]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(m["loss"])) for m in steps), steps
    assert all(m["reward/std"] > 0 for m in steps), steps  # groups with advantages: an update happened

    before = load_model(str(model_dir)).state_dict()
    after = load_model(str(run.run_dir / "final")).state_dict()
    vision = ("model.vision_tower.", "model.multi_modal_projector.")
    moved = {k for k, v in after.items() if not torch.equal(v, before[k])}
    assert moved and all(k.startswith("model.language_model.") or k == "lm_head.weight" for k in moved)
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith(vision))
    assert type(load_processor(str(run.run_dir / "final"))).__name__ == "LlavaProcessor"
    samples = [row for _, row in JsonlReader(run.run_dir / "samples.jsonl")]
    assert {Path(s["images"][0]["source"]).name for s in samples} <= {f"{c}.png" for c in COLOURS}
