"""The local runtime's device (``runtime.device``): every model of the run (the policy the
learner trains and the generator samples with, the KL reference, PPO's critic, a
preference method's model) computes on it, while the batches and what the roles hand each
other stay on the CPU; a run there trains and resumes from its checkpoint. On this
machine the ``cpu`` cases run; the ``cuda`` ones run where torch sees a GPU
(``benchmarks/gpu/local_device.sh``)."""

from __future__ import annotations

import math

import pytest
import torch

from rltune.config import load_config
from rltune.runtime.clock import StepClock
from rltune.runtime.local import build_run, local_device
from rltune.runtime.loop import train

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@pytest.mark.parametrize("device", DEVICES)
def test_ppo_with_a_reference_computes_on_the_run_device(tiny_grpo_config, device):
    """PPO with a KL term has every model role: policy (shared with the generator),
    reference and critic. Each sits on the run's device; the log-probs and values the
    roles return are on the CPU; two steps train and a third resumes from the checkpoint."""
    overrides = ("algo.name=ppo", "algo.kl_coef=0.05", "algo.group_size=2", "train.prompts_per_step=2",
                 "rollout.max_new_tokens=4", "train.steps=2", "checkpoint.every=2", "checkpoint.resume=auto",
                 "train.threads=1", f"runtime.device={device}")
    cfg = tiny_grpo_config(*overrides)
    run = build_run(cfg)
    where = local_device(cfg)
    assert where.type == device
    for role in (run.learner.model, run.roles.reference.model, run.roles.critic.model):
        assert _device_of(role) == where
    history = train(run)
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    assert run.learner.version > 0

    resumed_cfg = tiny_grpo_config(*overrides[:-1], "train.steps=3", f"runtime.device={device}")
    resumed = build_run(resumed_cfg)
    more = train(resumed)
    assert resumed.step == 3 and len(more) == 1
    # the checkpoint's weights came back onto the device, and training went on from them
    assert _device_of(resumed.learner.model) == where and math.isfinite(more[0]["loss"])


@pytest.mark.parametrize("device", DEVICES)
def test_roles_hand_back_cpu_tensors(tiny_grpo_config, device):
    """What the loop receives from the learner and the reference is on the CPU. Before any
    step the two are copies of the same weights on the same device, run in the same
    chunks, so their log-probs agree: exactly on a CPU; 1e-5 leaves room for a GPU kernel
    whose reduction order is not fixed (fp32 log-probs of order 1, relative error ~1e-7
    per sum over a 3-layer model's few hundred terms)."""
    cfg = tiny_grpo_config("algo.kl_coef=0.05", "algo.group_size=2", "train.prompts_per_step=2",
                           "rollout.max_new_tokens=4", "train.steps=1", "train.threads=1",
                           f"runtime.device={device}")
    run = build_run(cfg)
    batch = run.source.next(StepClock()).batch  # generated, scored, with its reference log-probs
    assert batch.input_ids.device.type == "cpu"
    logprobs = run.learner.logprobs(batch)
    reference = run.roles.reference.logprobs(batch)
    assert logprobs.device.type == reference.device.type == "cpu"
    assert torch.allclose(logprobs, reference, atol=1e-5)  # no step yet: the policy is the reference


@pytest.mark.parametrize("device", DEVICES)
def test_dpo_reference_and_training_on_the_run_device(tmp_path, device):
    """DPO computes its reference log-probs with the model on the run's device before the
    first step (cached on the CPU in the run directory), then trains and evaluates there."""
    cfg = load_config(None, [
        "name=dpo-device", "model.path=builtin:tiny", "algo.name=dpo", "algo.beta=0.1",
        "data.train=builtin:arith_prefs/train", "data.eval=builtin:arith_prefs/eval", "eval.max_prompts=8",
        "data.chat_template=false", "train.steps=2", "train.prompts_per_step=4", "train.lr=1e-3",
        "train.threads=1", f"log.dir={tmp_path / 'runs'}", "log.console=false", "checkpoint.final=false",
        f"runtime.device={device}",
    ])
    run = build_run(cfg)
    assert _device_of(run.learner.model).type == device
    history = train(run)
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    assert (run.run_dir / "reference_logps.safetensors").is_file()
