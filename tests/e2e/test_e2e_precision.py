"""``train.precision`` end to end on the tiny model: a GRPO run learns at each precision a
CPU can run (fp32, bf16, fp16) while the lr-0 control does not; an fp16 run stopped and
resumed is the run that did not stop, bit for bit, loss scale included; fp8 is refused
by the CLI before the model loads.

fp16 on a CPU is slow (no fp16 matrix-product kernel: a learner step takes about 6x
fp32's), so the fp16 runs here are short, and the fp16 learning run and its control are
marked slow.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
import torch

import rltune.learner.precision as precision_module
import rltune.runtime.roles
from rltune.checkpoint.store import META_FILE as STATE_FILE
from rltune.cli import main
from rltune.runtime.clock import StepClock
from rltune.runtime.local import build_run
from rltune.runtime.loop import train

SHORT = ("train.steps=12", "train.prompts_per_step=4", "train.threads=1")
STEPS, STOP_AT = 4, 2
RESUME = (
    f"train.steps={STEPS}", "train.prompts_per_step=2", "algo.group_size=4", "rollout.max_new_tokens=6",
    "train.precision=fp16", "data.shuffle=true", f"checkpoint.every={STOP_AT}", "checkpoint.resume=auto",
    "train.threads=1",
)

pytestmark = pytest.mark.usefixtures("keep_torch_threads")


def _curve(cfg) -> list[float]:
    return [m["reward/mean"] for m in train(build_run(cfg))]


# fp16 takes ~35 s here (slow); the fp16 resume runs below are the default set's fp16 runs
@pytest.mark.parametrize("precision", ["fp32", "bf16", pytest.param("fp16", marks=pytest.mark.slow)])
def test_each_cpu_precision_learns(tiny_grpo_config, precision):
    curve = _curve(tiny_grpo_config(*SHORT, "train.lr=5e-3", f"train.precision={precision}"))
    first, last = statistics.mean(curve[:4]), statistics.mean(curve[-4:])
    # The curve depends on the CPU's kernels (bf16 products differ between CPUs with and
    # without native bf16), so the bound leaves room: seeds 0-2 on an AVX2-only CPU gave
    # first 0.05-0.07 and last 0.47-0.76 (bf16), 0.06-0.07 and 0.63-0.74 (fp32), where
    # 10 steps left seed 0's bf16 run at +0.17; the control stays near 0.05.
    assert first < 0.15, curve
    assert last > first + 0.2, curve


@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp16", marks=pytest.mark.slow)])
def test_control_with_zero_lr_does_not_learn(tiny_grpo_config, precision):
    curve = _curve(tiny_grpo_config(*SHORT, "train.lr=0", f"train.precision={precision}"))
    assert abs(statistics.mean(curve[-5:]) - statistics.mean(curve[:5])) < 0.1, curve


# --------------------------------------------------------------------------- exact resume


def _deterministic(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "perf/")) and not k.endswith("_per_s")}
            for m in history]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, tiny_grpo_config_at):
    """Run A: 4 fp16 steps straight; run B: stopped after step 2, resumed by a fresh
    build. The scale doubles after every clean step (growth interval 1), so it differs at
    every step and a resume that lost it would show."""
    patch = pytest.MonkeyPatch()
    patch.setattr(precision_module, "GROWTH_INTERVAL", 1)
    root = tmp_path_factory.mktemp("fp16-resume")
    run_a = build_run(tiny_grpo_config_at(root / "a", *RESUME))
    history_a = train(run_a)
    cfg_b = tiny_grpo_config_at(root / "b", *RESUME)
    first = build_run(cfg_b)
    history_b = train(first, stop_after=STOP_AT)
    at_stop = root / "b-at-stop"
    shutil.copytree(first.run_dir, at_stop)
    run_b = build_run(cfg_b)
    history_b += train(run_b)
    yield run_a, history_a, run_b, history_b, at_stop, patch
    patch.undo()


def test_fp16_resume_is_bitwise_the_run_that_did_not_stop(resumed):
    run_a, history_a, run_b, history_b, _, _ = resumed
    assert len(history_b) == STEPS
    assert _deterministic(history_a) == _deterministic(history_b)
    scales = [m["train/loss_scale"] for m in history_a]
    assert scales == [2.0 ** (17 + k) for k in range(STEPS)], scales  # the scale carried over the stop
    sa, sb = run_a.learner.model.state_dict(), run_b.learner.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert run_a.learner.learner.precision.state_dict() == run_b.learner.learner.precision.state_dict()
    # the checkpoint B resumed from holds the scale as JSON (the scale after step 2)
    meta = json.loads((at_stop_of(resumed) / "checkpoints" / f"step-{STOP_AT}" / STATE_FILE).read_text())
    assert meta["learner"]["precision"]["scale"] == scales[STOP_AT - 1]


def at_stop_of(resumed) -> Path:
    return resumed[4]


def test_resume_without_the_scaler_state_differs(resumed, tmp_path, tiny_grpo_config_at, monkeypatch):
    """The control: the same resume with the scaler's state not loaded starts again from
    the first scale, and its metrics differ from run A's."""
    _, history_a, _, _, at_stop, _ = resumed
    monkeypatch.setattr(precision_module, "GROWTH_INTERVAL", 1)
    monkeypatch.setattr(precision_module.Precision, "load_state_dict", lambda self, state: None)
    cfg = tiny_grpo_config_at(tmp_path, *RESUME)
    shutil.copytree(at_stop, Path(cfg.log.dir) / cfg.name)
    history = train(build_run(cfg))
    assert len(history) == STEPS - STOP_AT  # it did resume
    assert _deterministic(history) != _deterministic(history_a[STOP_AT:])


# --------------------------------------------------------------------------- fp8 on the CLI


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_reference_computes_under_the_learners_precision(tiny_grpo_config, precision):
    """Before the first update the reference is the policy, and it computes under the
    learner's autocast, so the KL term starts at 0, not at the rounding between a bf16
    policy and a float32 reference. Bound: 1e-5, the float32 summation-order gap between
    the learner's forward and the reference's (log-probs of order 5, relative error ~1e-7
    per sum over a few hundred terms); bf16 rounds each product to 2^-8 relative, which
    put a float32 reference ~1e-3 away from the bf16 policy here."""
    cfg = tiny_grpo_config("algo.kl_coef=0.05", "algo.group_size=2", "train.prompts_per_step=2",
                           "rollout.max_new_tokens=4", "train.steps=1", "train.threads=1",
                           f"train.precision={precision}")
    run = build_run(cfg)
    batch = run.source.next(StepClock()).batch  # generated, scored, with its reference log-probs
    assert (run.learner.logprobs(batch) - batch.ref_logprobs).abs().max() <= 1e-5


def test_cli_refuses_fp8_before_loading_the_model(tmp_path, digit_reward_file, capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the precision was refused")

    monkeypatch.setattr(rltune.runtime.roles, "load_model", no_load)
    monkeypatch.setenv("COLUMNS", "500")
    path = tmp_path / "fp8.yaml"
    path.write_text("\n".join([
        "model: {path: 'builtin:tiny'}", "algo: {name: grpo, group_size: 2}",
        "data: {train: 'builtin:arith_small/train'}", f"reward: [{{fn: '{digit_reward_file}:digit_share'}}]",
        "train: {steps: 1, precision: fp8}", f"log: {{dir: '{tmp_path / 'runs'}', console: false}}",
    ]))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.precision=fp8 cannot run here" in err and "no CUDA GPU" in err
    assert "Traceback" not in err
