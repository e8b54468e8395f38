"""The search task trained on CPU: a warm-up by SFT that searches about half the time,
then GRPO with the search tool over the real document store (builtin:lookup's corpus in
the embedded FAISS store, embedded by the local MiniLM model). The policy learns to
search: the tool-call rate and the reward rise. The control, whose store is empty, gets
nothing from searching and does not. Both run the recipes the README points to, with
fewer steps."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from rltune.config import load_config
from rltune.data.tasks.lookup import lookup_documents
from rltune.runtime.local import build_run, run_local
from rltune.runtime.loop import train

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

DOCS = {d["id"]: d["text"] for d in lookup_documents()}
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
WARMUP_STEPS = 300
RL_STEPS = 15


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    log_dir = tmp_path_factory.mktemp("search")
    cfg = load_config(RECIPES / "lookup-sft.yaml", [
        f"train.steps={WARMUP_STEPS}", "eval.every=0", "data.eval=null", f"log.dir={log_dir}",
        "log.console=false",
    ])
    run_local(cfg)
    return log_dir / "lookup-sft" / "final"


def _grpo(warm: Path, log_dir: Path, *overrides: str) -> tuple[list[dict], list[dict]]:
    cfg = load_config(RECIPES / "lookup-grpo.yaml", [
        f"model.path={warm}", f"train.steps={RL_STEPS}", "eval.every=0", "data.eval=null",
        f"log.dir={log_dir}", "log.console=false", "checkpoint.final=false", "train.threads=1", *overrides,
    ])
    run = build_run(cfg)
    train(run)
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run.run_dir / "samples.jsonl").read_text().splitlines()]
    return rows, samples


def _curve(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


def test_the_policy_learns_to_search(warm_model: Path, tmp_path: Path) -> None:
    rows, samples = _grpo(warm_model, tmp_path)
    calls, reward = _curve(rows, "env/tool_call_frac"), _curve(rows, "reward/mean")
    # from the warm-up's ~40 % of sampled episodes to most of them within 15 steps
    assert statistics.mean(calls[-5:]) > statistics.mean(calls[:3]) + 0.25, calls
    assert statistics.mean(reward[-5:]) > statistics.mean(reward[:3]) + 0.08, reward
    # the samples show the exchange: the model's call (trained) and the store's answer
    searched = [s for s in samples if len(s["turns"]) == 2]
    assert len(searched) > len(samples) / 2
    for s in searched:
        call, result = s["turns"]
        assert call["trained"] and not result["trained"]
        assert s["completion"] == result["content"] and '"name": "search"' in call["content"]
        name = s["prompt"].removeprefix("code of ").removesuffix("?")
        code = DOCS[name].split()[-1]
        assert s["reward"] == (1.0 if result["content"].split()[-1] == code else 0.0), (name, result)


def test_control_with_an_empty_store_does_not_learn_to_search(warm_model: Path, tmp_path: Path) -> None:
    rows, samples = _grpo(warm_model, tmp_path, "env.kwargs.search={kind: embedded, embedder: minilm}")
    calls, reward = _curve(rows, "env/tool_call_frac"), _curve(rows, "reward/mean")
    assert statistics.mean(calls[-5:]) < statistics.mean(calls[:3]) + 0.1, calls
    assert max(reward) < 0.05, reward
    assert all(s["completion"] == "no results" for s in samples if len(s["turns"]) == 2)
