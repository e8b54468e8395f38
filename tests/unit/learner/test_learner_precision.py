"""``train.precision`` in the learner: fp16's dynamic loss scaling (an overflowed step is
skipped without touching the weights or the optimizer, the scale halves, the next step
applies; the optimizer sees unscaled gradients), the scaler's checkpoint state, and fp8
refused cleanly where it cannot run."""

from __future__ import annotations

import copy
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from rltune.config import load_config
from rltune.data.collate import collate_rollouts
from rltune.data.records import Prompt, SamplingParams
from rltune.learner.learner import LocalLearner
from rltune.learner.precision import (
    Precision,
    _float8_or_plain,
    PrecisionError,
    check_precision,
    fp8_problems,
    generator_precision,
    learner_precision,
    precision_problems,
    vllm_dtype,
)
from rltune.metrics import keys
from rltune.metrics.types import scalars
from rltune.parallel.layout import Layout
from rltune.rollout.hf import HFGenerator
from test_learner_step import grpo_batch, make_learner, step_and_capture


def _state(learner: LocalLearner) -> tuple[dict, dict]:
    params = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    optim = copy.deepcopy(learner.optimizer.state_dict())
    return params, optim


def _same_optimizer(a: dict, b: dict) -> bool:
    if a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


def _blown_up(batch, factor: float = 1e6):
    """The batch with advantages so large that, times the loss scale, the fp16 backward
    overflows (65504 is fp16's largest value)."""
    return dataclasses.replace(batch, advantages=batch.advantages * factor)


def test_overflowed_step_is_skipped_and_the_scale_backs_off(tiny_model):
    learner = make_learner(copy.deepcopy(tiny_model), "grpo", "token-mean", precision="fp16", grad_clip=1.0)
    batch = grpo_batch(tiny_model)
    first = scalars(learner.step(batch))
    assert first[keys.SKIPPED_OVERFLOW] == 0.0 and first[keys.LOSS_SCALE] == 2.0**16
    params, optim = _state(learner)

    blown = scalars(learner.step(_blown_up(batch)))
    assert blown[keys.SKIPPED_OVERFLOW] == 1.0 and blown["skipped"] == 1.0
    assert blown[keys.LOSS_SCALE] == 2.0**15  # halved
    # an overflow is not a non-finite step: it does not count towards max_nonfinite_steps
    assert learner.nonfinite_in_a_row == 0 and learner.nonfinite_total == 0
    assert learner.version == 1
    now_params, now_optim = _state(learner)
    assert all(torch.equal(params[n], now_params[n]) for n in params), "the skipped step moved a weight"
    assert _same_optimizer(optim, now_optim), "the skipped step changed AdamW's state"
    assert now_optim["state"][0]["step"] == 1  # AdamW's own step count too

    recovered = scalars(learner.step(batch))
    assert recovered[keys.SKIPPED_OVERFLOW] == 0.0 and recovered[keys.LOSS_SCALE] == 2.0**15
    assert learner.version == 2
    after, _ = _state(learner)
    assert any(not torch.equal(params[n], after[n]) for n in params), "the next step did not apply"
    assert learner.precision.overflows == 1


def test_overflows_in_a_row_never_stop_the_run(tiny_model):
    """``max_nonfinite_steps`` counts non-finite steps the scaler did not flag; a run whose
    scale is too large backs off as many times as it needs."""
    learner = make_learner(copy.deepcopy(tiny_model), "grpo", "token-mean", precision="fp16",
                           max_nonfinite_steps=1)
    batch = _blown_up(grpo_batch(tiny_model))
    for k in range(3):
        out = scalars(learner.step(batch))
        assert out[keys.SKIPPED_OVERFLOW] == 1.0 and out[keys.LOSS_SCALE] == 2.0 ** (15 - k)


def test_fp16_optimizer_sees_the_unscaled_gradient(tiny_model):
    """The gradient AdamW steps on under fp16 is fp32's, up to fp16 rounding. Tolerance:
    fp16 keeps 11 significant bits (relative rounding 2^-11 = 4.9e-4 per operation); through
    4 layers' matmuls, softmax and the log-prob reduction the errors add up to about 1e-2 of
    the gradient's norm at most (measured: 9.5e-4). Forgetting to unscale would be off by
    the scale, 65536 times."""
    batch = grpo_batch(tiny_model)
    _, want = step_and_capture(make_learner(copy.deepcopy(tiny_model), "grpo", "token-mean"), batch)
    _, got = step_and_capture(
        make_learner(copy.deepcopy(tiny_model), "grpo", "token-mean", precision="fp16"), batch)
    num = sum(float((got[n] - want[n]).norm() ** 2) for n in want) ** 0.5
    den = sum(float(want[n].norm() ** 2) for n in want) ** 0.5
    assert num / den < 1e-2, num / den


def test_scaler_state_round_trips_through_json():
    source = Precision("fp16", "cpu", init_scale=1024.0)
    weight = torch.nn.Parameter(torch.zeros(2))
    source.scale(torch.ones(()))  # the scaler starts at its first scale()
    weight.grad = torch.tensor([1.0, float("inf")])
    overflow = source.unscale(torch.optim.SGD([weight]))
    assert overflow
    source.update(overflow)
    state = json.loads(json.dumps(source.state_dict()))  # what a checkpoint's meta holds
    assert state == {"scale": 512.0, "growth_tracker": 0, "overflows": 1}
    target = Precision("fp16", "cpu")
    target.load_state_dict(state)
    assert target.loss_scale() == 512.0 and target.overflows == 1
    plain = Precision("fp32", "cpu")
    assert plain.state_dict() == {} and plain.loss_scale() is None
    plain.load_state_dict(state)  # an fp16 checkpoint into an fp32 run: nothing to restore


def test_bf16_and_fp32_have_no_scaler_metrics(tiny_model):
    for precision in ("fp32", "bf16"):
        learner = make_learner(copy.deepcopy(tiny_model), "grpo", "token-mean", precision=precision)
        out = scalars(learner.step(grpo_batch(tiny_model)))
        assert keys.SKIPPED_OVERFLOW not in out and keys.LOSS_SCALE not in out


# --------------------------------------------------------------------------- fp8, layouts


def test_fp8_problems_name_what_is_missing():
    both = fp8_problems(torchao=False, cuda=False)
    assert len(both) == 2
    assert "pip install 'rltune[fp8]'" in both[0] and "no CUDA GPU" in both[1]
    old = fp8_problems(torchao=True, cuda=True, capability=(8, 0))
    assert len(old) == 1 and "compute capability 8.0" in old[0] and "8.9" in old[0]
    assert fp8_problems(torchao=True, cuda=True, capability=(9, 0)) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_fp8_is_refused_on_cpu_before_the_model_loads(tiny_model):
    cfg = load_config(None, ["model.path=builtin:tiny", "train.precision=fp8"])
    with pytest.raises(PrecisionError, match="train.precision=fp8 cannot run here: .*no CUDA GPU"):
        check_precision(cfg)
    # a learner built directly (the Python API) refuses it as well, before touching the model
    model = copy.deepcopy(tiny_model)
    with pytest.raises(PrecisionError, match="no CUDA GPU"):
        make_learner(model, "grpo", "token-mean", precision="fp8")
    assert any(type(m) is torch.nn.Linear for m in model.modules())  # nothing converted


def test_fp16_over_bf16_weights_is_refused_before_the_model_loads():
    # autocast to fp16 over bf16 weights ended in an autocast RuntimeError after a step
    cfg = load_config(None, ["model.path=builtin:tiny", "train.precision=fp16", "model.dtype=bfloat16"])
    with pytest.raises(PrecisionError, match="train.precision=fp16 with model.dtype=bfloat16: .*float32 master weights"):
        check_precision(cfg)
    check_precision(load_config(None, ["model.path=builtin:tiny", "train.precision=bf16", "model.dtype=bfloat16"]))


def test_fp16_through_a_pipeline_is_refused():
    (problem,) = precision_problems("fp16", Layout(pp=2, dp_shard=1))
    assert "train.parallel.pp=2" in problem and "bf16" in problem
    assert precision_problems("bf16", Layout(pp=2)) == []
    assert precision_problems("fp16", Layout(tp=2)) == []


def test_generator_follows_the_learner_precision():
    def cfg(*overrides):
        return load_config(None, ["model.path=builtin:tiny", *overrides])

    assert generator_precision(cfg("train.precision=fp16")) == "fp16"
    assert generator_precision(cfg("train.precision=bf16")) == "bf16"
    assert generator_precision(cfg("train.precision=fp8")) == "bf16"
    assert generator_precision(cfg("train.precision=fp16", "rollout.precision=fp32")) == "fp32"
    assert vllm_dtype(cfg("train.precision=fp16")) == "float16"
    assert vllm_dtype(cfg("model.dtype=bfloat16")) == "bfloat16"  # fp32 training: the weights' dtype


def test_fp16_through_a_pipeline_is_refused_by_the_learner_too(tiny_model):
    """A learner built directly (the Python API) with a pipeline strategy refuses fp16."""
    pipelined = SimpleNamespace(pipeline=object())
    with pytest.raises(PrecisionError, match="pp > 1"):
        learner_precision("fp16", tiny_model, pipelined)


def test_generator_samples_under_the_learner_precision(tiny_model, tiny_path):
    """The same draws at fp32 and fp16: the fp16 generator's log-probs are the fp32 ones
    up to fp16 rounding (about 1e-3 here; 2^-11 relative per operation), and not equal to
    them (which they would be if the precision were ignored)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    prompts = [Prompt(id=str(i), text="", input_ids=tokenizer.encode(f"{i} + {i} =")) for i in range(4)]
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0)
    out = {}
    for precision in ("fp32", "fp16"):
        generator = HFGenerator(copy.deepcopy(tiny_model), tokenizer, rng=torch.Generator().manual_seed(0),
                                precision=precision)
        out[precision] = generator.generate(prompts, params)
    for a, b in zip(out["fp32"], out["fp16"]):
        if not torch.equal(a.completion_ids, b.completion_ids):
            continue  # a draw that rounding moved: the log-probs are of other tokens
        gap = (a.completion_logprobs - b.completion_logprobs).abs().max()
        assert gap < 1e-2, gap
    gaps = [float((a.completion_logprobs - b.completion_logprobs).abs().max())
            for a, b in zip(out["fp32"], out["fp16"]) if torch.equal(a.completion_ids, b.completion_ids)]
    assert gaps and max(gaps) > 0


def test_fp8_on_ray_is_judged_by_the_learners_gpus_not_this_machines():
    """The driver of a Ray run (a head node, a laptop) often has no GPU while the
    learners have; it checks only that they reserve one, and each learner checks its own
    GPU and torchao as it starts (``Precision``)."""
    ray = ["model.path=builtin:tiny", "train.precision=fp8", "runtime.mode=ray"]
    check_precision(load_config(None, [*ray, "runtime.placement.learner.gpus=1"]))
    with pytest.raises(PrecisionError, match=r"the learners reserve none \(runtime.placement.learner.gpus: 0\)"):
        check_precision(load_config(None, ray))


class _Float8Like(torch.nn.Linear):
    """A class of its own, as torchao's ``Float8Linear`` is: the generator's lean decode
    takes plain ``nn.Linear`` only, so the model's own forward runs, as with fp8."""


def test_fp8_linears_are_plain_products_in_the_decode_and_float8_in_the_learner(tiny_model, tiny_path):
    """``convert_fp8`` gives each float8 linear :func:`_float8_or_plain`'s forward (torchao
    needs a CUDA GPU, so a stand-in for its float8 forward records each call here). The HF
    generator's decode (``torch.inference_mode``) never reaches the float8 forward: it
    samples with plain products in its own precision, the same draws and log-probs to the
    bit as the unconverted model under the same bf16 autocast. The learner's no-grad
    log-probs and its training forward do reach it, with autocast off inside and the input
    in the autocast dtype."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    prompts = [Prompt(id=str(i), text="", input_ids=tokenizer.encode(f"{i} + {i} =")) for i in range(3)]
    params = SamplingParams(n=2, max_new_tokens=5, temperature=1.0)
    calls: list[tuple[torch.dtype, bool]] = []

    def float8_forward(module):
        def forward(x):
            calls.append((x.dtype, torch.is_autocast_enabled("cpu")))
            return torch.nn.functional.linear(x, module.weight.to(x.dtype), module.bias.to(x.dtype)
                                              if module.bias is not None else None)
        return forward

    plain, converted = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    for model in (plain, converted):  # both off the lean decode, so the two run the same code
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
                module.__class__ = _Float8Like
                if model is converted:
                    module.forward = _float8_or_plain(module, float8_forward(module))
    out = {}
    for key, model in (("plain", plain), ("converted", converted)):
        generator = HFGenerator(model, tokenizer, rng=torch.Generator().manual_seed(0), precision="bf16")
        out[key] = generator.generate(prompts, params)
    assert calls == []  # the decode never ran the float8 forward
    for a, b in zip(out["plain"], out["converted"], strict=True):
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.completion_logprobs, b.completion_logprobs)

    learner = make_learner(converted, "grpo", "token-mean", precision="bf16")
    batch = collate_rollouts(out["converted"], pad_id=tokenizer.pad_token_id)
    learner.logprobs(batch)
    assert calls and set(calls) == {(torch.bfloat16, False)}  # float8, in the autocast dtype, autocast off
    calls.clear()
    batch.advantages = torch.ones_like(batch.loss_mask)
    learner.step(batch)
    assert calls and set(calls) == {(torch.bfloat16, False)}
