"""`rltune export` of a reward-model run (``algo.name: reward_model``): the output is a
sequence classifier with one label that plain transformers loads
(``AutoModelForSequenceClassification``), with the tokenizer, and it scores an input as
the trained model did; a LoRA reward model comes out merged. A PPO run exports its
policy, not its critic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rltune.checkpoint import load_checkpoint
from rltune.cli import main
from rltune.config import load_config
from rltune.models.load import resolve_model
from rltune.models.reward_model import load_reward_model, sequence_scores
from rltune.runtime.local import run_local

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

# One input of the tiny model's vocabulary with no pad token (id 0) in it: transformers'
# own forward reads the score at the last token that is not the pad id, rltune's at the
# last attended one; without a pad token inside, both are the last token.
IDS = torch.tensor([[30, 70, 11, 122, 95, 14, 3]])
MASK = torch.ones_like(IDS)

VARIANTS = {"full": [], "lora": ["model.lora.r=4", "model.lora.alpha=8"]}


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """One message per line, paths included (rich wraps at 80 columns otherwise)."""
    monkeypatch.setenv("COLUMNS", "500")


def _config(log_dir: Path, *overrides: str):
    return load_config(None, [
        "name=rm-run",
        "model.path=builtin:tiny",
        "algo.name=reward_model",
        "data.train=builtin:arith_prefs/train",
        "data.chat_template=false",
        "train.steps=2",
        "train.prompts_per_step=4",
        "train.lr=1e-2",
        "train.seed=5",
        "train.threads=1",
        "checkpoint.every=1",
        "checkpoint.final=false",
        f"log.dir={log_dir}",
        "log.console=false",
        *overrides,
    ])


@pytest.fixture(scope="module")
def rm_runs(tmp_path_factory):
    """``get(variant)``: a real 2-step reward-model run (full or LoRA), made once."""
    runs = {}

    def get(variant: str):
        if variant not in runs:
            runs[variant] = run_local(_config(tmp_path_factory.mktemp(variant), *VARIANTS[variant]))
        return runs[variant]

    return get


def _trained_score(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return sequence_scores(model.eval(), IDS, MASK)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_reward_model_run_exports_a_sequence_classifier(capsys, rm_runs, tmp_path, variant):
    run = rm_runs(variant)
    out = tmp_path / "rm"
    code = main(["export", str(run.run_dir), str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert f"exported {run.run_dir / 'checkpoints' / 'step-2'} to {out}" in err

    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]
    assert not list(out.glob("adapter*"))  # LoRA comes out merged: no peft needed
    exported = AutoModelForSequenceClassification.from_pretrained(out, num_labels=1, local_files_only=True).eval()
    assert exported.config.num_labels == 1
    with torch.no_grad():
        got = exported(input_ids=IDS, attention_mask=MASK).logits[:, 0]
    expected = _trained_score(run.learner.model)  # the model the run ended with: step 2
    # The exported weights are the trained ones (float32, saved and read back bit for
    # bit; LoRA merged as W + (alpha/r) B A, one rounding per weight). What may differ is
    # the order of float32 sums: transformers' head runs on every position, rltune's on
    # the last one, and a merged layer is one matmul instead of two. Each such change
    # moves a sum of ~H=128 terms by a few ulps (eps = 1.2e-7) of its terms' size; 1e-5
    # relative (~80 ulps) covers that, and a wrong head or missing adapter is off by
    # orders more (the check below: training moved the score by > 1e-3).
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    base = load_reward_model(resolve_model("builtin:tiny"), seed=5)
    assert (got - _trained_score(base)).abs().max() > 1e-3

    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tokenizer.pad_token_id == 0 and len(tokenizer) == exported.config.vocab_size


def test_the_exported_head_is_the_checkpoints(rm_runs, tmp_path, capsys):
    """Bitwise: the ``score`` head and decoder of a full reward-model checkpoint are the
    exported tensors, not a newly drawn head."""
    run = rm_runs("full")
    assert main(["export", str(run.run_dir), str(tmp_path / "rm"), "--checkpoint",
                 str(run.run_dir / "checkpoints" / "step-1")]) == 0
    saved = load_checkpoint(run.run_dir / "checkpoints" / "step-1")[0]["model"]
    exported = load_file(tmp_path / "rm" / "model.safetensors")
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


def test_a_ppo_run_exports_the_policy_not_the_critic(tiny_grpo_config, tmp_path, capsys):
    """A PPO checkpoint holds the policy (``model``) and the critic (``critic_model``, a
    body with a value head); the export is the policy, a causal LM."""
    run = run_local(tiny_grpo_config("algo.name=ppo", "algo.group_size=2", "train.steps=1",
                                     "train.prompts_per_step=2", "train.threads=1", "checkpoint.every=1"))
    assert main(["export", str(run.run_dir), str(tmp_path / "out")]) == 0
    tensors = load_checkpoint(run.run_dir / "checkpoints" / "step-1")[0]
    assert "critic_model" in tensors
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert set(exported) <= set(tensors["model"]) and not any(k.startswith("head.") for k in exported)
    assert all(torch.equal(exported[k], tensors["model"][k]) for k in exported)
