"""The runnable examples: a custom reward in under 10 lines and a custom environment in
under 30, each trained for a few steps from its own config, as a user would run them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.config import load_config
from rltune.metrics.jsonl import JsonlReader
from rltune.runtime.local import build_run
from rltune.runtime.loop import train

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _code_lines(path: Path) -> int:
    """Lines that are not blank, comments or the module docstring."""
    text = path.read_text()
    body = text.split('"""', 2)[2] if text.startswith('"""') else text
    return sum(1 for line in body.splitlines() if line.strip() and not line.strip().startswith("#"))


def _run(name: str, tmp_path: Path) -> tuple[list[dict], list[dict]]:
    config = EXAMPLES / f"{name}.yaml"
    cfg = load_config(config, ["train.steps=3", "train.threads=1", f"log.dir={tmp_path}", "log.console=false"])
    run = build_run(cfg, config_dir=config.parent)
    history = train(run)
    samples = [row for _, row in JsonlReader(run.run_dir / "samples.jsonl")]
    return history, samples


def test_custom_reward_example(tmp_path: Path) -> None:
    assert _code_lines(EXAMPLES / "custom_reward.py") < 10
    history, samples = _run("custom_reward", tmp_path)
    assert len(history) == 3 and all(m["reward/errors"] == 0 for m in history)
    assert {s["rewards"].keys() == {"brevity"} for s in samples} == {True}


def test_custom_env_example(tmp_path: Path) -> None:
    assert _code_lines(EXAMPLES / "custom_env.py") < 30
    history, samples = _run("custom_env", tmp_path)
    assert len(history) == 3 and all(m["env/errors"] == 0 for m in history)
    # the untrained model rarely says a number: most episodes get hints and use all turns
    multi = [s for s in samples if len(s["turns"]) > 1]
    assert multi
    for s in multi:
        assert [t["role"] for t in s["turns"]][:2] == ["assistant", "tool"]
        assert s["turns"][1]["trained"] is False and s["masked_tokens"] > 0
        assert s["masked_tokens"] == sum(t["tokens"] for t in s["turns"] if not t["trained"])
        assert s["trained_tokens"] == sum(t["tokens"] for t in s["turns"] if t["trained"])
    assert all(s["reward"] == s["rewards"]["env"] for s in samples)
