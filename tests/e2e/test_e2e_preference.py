"""DPO, SimPO and reward-model training of the tiny model on ``builtin:arith_prefs`` raise
held-out preference accuracy and margin; the same runs with lr 0 (the control) leave
them where they started.

The runs use the library pieces directly, as the runtime does: ``build_preference_parts``
for model, objective, data, collate and evaluation, a ``PromptSampler`` and a
``LocalLearner``. The held-out split shares no problem with train (in either operand
order). An untrained model starts at chance (SimPO, reward model: accuracy near 0.5) or,
for DPO, at exactly 0 accuracy and 0 margin: its implicit rewards are all 0, ties that
count as wrong. A wrong loss sign drives accuracy below 0.5 and the margin below 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rltune.checkpoint.export import export_hf
from rltune.config import load_config
from rltune.data.sampler import PromptSampler
from rltune.learner.learner import LocalLearner
from rltune.models.load import load_tokenizer, resolve_model
from rltune.models.reward_model import load_reward_model, score_completions
from rltune.runtime.preference import build_preference_parts

STEPS = 50
# per method: lr, and the algo keys it trains with (SimPO's beta 2 / gamma 1 are its preset)
SETTINGS = {
    "dpo": ("2e-3", ["algo.beta=0.1"]),
    "simpo": ("2e-3", []),
    "reward_model": ("1e-3", []),
}


def _config(root: Path, algo: str, lr: str):
    return load_config(None, [
        f"name=prefs-{algo}",
        "model.path=builtin:tiny",
        f"algo.name={algo}",
        *SETTINGS[algo][1],
        "data.train=builtin:arith_prefs/train",
        "data.eval=builtin:arith_prefs/eval",
        # the plain prompt "37+45=": a third of the chat template's tokens, same task
        "data.chat_template=false",
        f"train.steps={STEPS}",
        "train.prompts_per_step=32",
        f"train.lr={lr}",
        "train.threads=1",  # tiny matrices: one thread is faster, and steady on a busy machine
        f"log.dir={root / 'runs'}",
        "log.console=false",
    ])


def _train(root: Path, algo: str, lr: str):
    """``(metrics before, metrics after, parts, tokenizer)`` of a run of ``STEPS`` steps."""
    cfg = _config(root, algo, lr)
    torch.set_num_threads(cfg.train.threads)
    model_dir = resolve_model(cfg.model.path)
    tokenizer = load_tokenizer(model_dir)
    run_dir = Path(cfg.log.dir) / cfg.name
    parts = build_preference_parts(cfg, model_dir=model_dir, tokenizer=tokenizer, run_dir=run_dir)
    learner = LocalLearner(parts.model, parts.objective, cfg.train)
    sampler = PromptSampler(len(parts.train_prompts), seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    before = parts.evaluate()
    for _ in range(cfg.train.steps):
        prompts = [parts.train_prompts[i] for i in sampler.next_batch(cfg.train.prompts_per_step)]
        learner.step(parts.collate(prompts))
    return before, parts.evaluate(), parts, tokenizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory, keep_torch_threads):
    """``get(algo)``: the run of ``algo`` at its lr, trained once per module."""
    runs: dict[str, tuple] = {}

    def get(algo: str):
        if algo not in runs:
            runs[algo] = _train(tmp_path_factory.mktemp(algo), algo, SETTINGS[algo][0])
        return runs[algo]

    return get


@pytest.mark.parametrize("algo", sorted(SETTINGS))
def test_preference_training_raises_held_out_accuracy(trained, algo):
    before, after, _, _ = trained(algo)
    acc0, acc1 = before["eval/pref/accuracy"], after["eval/pref/accuracy"]
    margin0, margin1 = before["eval/pref/margin"], after["eval/pref/margin"]
    if algo == "dpo":
        assert (acc0, margin0) == (0.0, 0.0)  # the policy is its own reference
    else:
        assert 0.4 < acc0 < 0.6, before  # an untrained model is near a coin flip
    # a coin flip over 300 pairs has std 0.029: 0.62 is four of them above it
    assert acc1 > 0.62 and acc1 > acc0 + 0.1, (before, after)
    assert margin1 > margin0 + 0.2, (before, after)


@pytest.mark.parametrize("algo", sorted(SETTINGS))
def test_control_with_zero_lr_does_not_learn(tmp_path, keep_torch_threads, algo):
    before, after, _, _ = _train(tmp_path, algo, "0")
    assert after == before


def test_trained_reward_model_scores_the_same_after_export(trained, tmp_path):
    """The trained reward model, written as an HF directory and loaded back, scores
    (prompt, response) pairs exactly as it did in training, and prefers the chosen
    response on the held-out pairs as often as the evaluation said."""
    _, after, parts, tokenizer = trained("reward_model")
    export_hf(parts.model, tokenizer, tmp_path / "rm")
    loaded = load_reward_model(str(tmp_path / "rm"))
    prompts = [p.input_ids for p in parts.eval_prompts] * 2
    responses = ([p.meta["chosen_ids"] for p in parts.eval_prompts]
                 + [p.meta["rejected_ids"] for p in parts.eval_prompts])
    expected = score_completions(parts.model, prompts, responses, tokenizer.pad_token_id)
    got = score_completions(loaded, prompts, responses, tokenizer.pad_token_id)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    n = len(parts.eval_prompts)
    accuracy = float((got[:n] > got[n:]).float().mean())
    assert accuracy == pytest.approx(after["eval/pref/accuracy"], abs=1 / n)


def test_dpo_reference_is_cached_with_the_run(tmp_path, keep_torch_threads):
    """A second build for the same run directory, as a resumed run does, reads the
    reference log-probs back instead of computing them, and gets the same numbers."""
    cfg = _config(tmp_path, "dpo", "2e-3")
    torch.set_num_threads(cfg.train.threads)
    model_dir = resolve_model(cfg.model.path)
    tokenizer = load_tokenizer(model_dir)
    run_dir = Path(cfg.log.dir) / cfg.name
    first = build_preference_parts(cfg, model_dir=model_dir, tokenizer=tokenizer, run_dir=run_dir)
    assert not first.reference.reused and (run_dir / "reference_logps.safetensors").is_file()
    again = build_preference_parts(cfg, model_dir=model_dir, tokenizer=tokenizer, run_dir=run_dir)
    assert again.reference.reused
    for split in ("train", "eval"):
        assert torch.equal(again.reference.splits[split], first.reference.splits[split])
    assert first.reference.splits["train"].shape == (4000, 2)
