"""``train.precision`` in the learner: fp16's dynamic loss scaling (an overflowed step is
skipped without touching the weights or the optimizer, the scale halves, the next step
applies; the optimizer sees unscaled gradients), the scaler's checkpoint state, and fp8
refused cleanly where it cannot run."""

from __future__ import annotations

import contextlib
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
    PrecisionError,
    check_precision,
    fp8_problems,
    generator_precision,
    learner_precision,
    plain_when_sampling,
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


class Float8Linear(torch.nn.Linear):
    """Stands in for torchao's class (which needs a CUDA GPU): found by its name, a class of
    its own (the generator's lean decode takes plain ``nn.Linear`` only, so the model's own
    forward runs, as with fp8), and its forward, the float8 product, records each call."""

    calls: list[tuple[torch.dtype, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Float8Linear.calls.append((x.dtype, torch.is_autocast_enabled(x.device.type)))
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)


def _float8_like(model: torch.nn.Module, *, wrapped: bool) -> torch.nn.Module:
    """``model`` with its block linears made :class:`Float8Linear`, wrapped as
    ``convert_fp8`` wraps torchao's (``wrapped``) or not."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            module.__class__ = Float8Linear
    return plain_when_sampling(model) if wrapped else model


def test_fp8_linears_are_plain_products_in_the_decode_and_float8_in_the_learner(tiny_model, tiny_path):
    """The HF generator's decode (``torch.inference_mode``) never reaches the float8
    forward: it samples with plain products in its own precision, the same draws and
    log-probs to the bit as the same layers unwrapped under the same bf16 autocast. The
    learner's no-grad log-probs and its training forward do reach it, with autocast off
    inside and the input in the autocast dtype."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    prompts = [Prompt(id=str(i), text="", input_ids=tokenizer.encode(f"{i} + {i} =")) for i in range(3)]
    params = SamplingParams(n=2, max_new_tokens=5, temperature=1.0)
    plain = _float8_like(copy.deepcopy(tiny_model), wrapped=False)
    converted = _float8_like(copy.deepcopy(tiny_model), wrapped=True)
    generated = HFGenerator(plain, tokenizer, rng=torch.Generator().manual_seed(0),
                            precision="bf16").generate(prompts, params)
    Float8Linear.calls.clear()
    out = HFGenerator(converted, tokenizer, rng=torch.Generator().manual_seed(0), precision="bf16").generate(prompts, params)
    assert Float8Linear.calls == []  # the decode never ran the float8 forward
    for a, b in zip(generated, out, strict=True):
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.completion_logprobs, b.completion_logprobs)

    learner = make_learner(converted, "grpo", "token-mean", precision="bf16")
    batch = collate_rollouts(out, pad_id=tokenizer.pad_token_id)
    learner.logprobs(batch)
    assert Float8Linear.calls and set(Float8Linear.calls) == {(torch.bfloat16, False)}  # autocast off inside
    Float8Linear.calls.clear()
    batch.advantages = torch.ones_like(batch.loss_mask)
    learner.step(batch)
    assert Float8Linear.calls and set(Float8Linear.calls) == {(torch.bfloat16, False)}


def test_a_copy_of_an_fp8_model_computes_with_its_own_weights():
    """An asynchronous producer samples with a deep copy of the policy: each wrapped layer
    of the copy is bound to the copy, not to the learner's layer it was copied from."""
    layer = plain_when_sampling(torch.nn.Sequential(Float8Linear(4, 4)))
    copied = copy.deepcopy(layer)
    with torch.no_grad():
        copied[0].weight.zero_()
        copied[0].bias.zero_()
    x = torch.ones(2, 4)
    for mode in (torch.inference_mode, torch.no_grad, contextlib.nullcontext):
        with mode():
            assert torch.equal(copied(x), torch.zeros(2, 4)) and not torch.equal(layer(x), torch.zeros(2, 4))


def test_a_compiled_block_with_fp8_linears_is_one_graph():
    """``train.compile`` compiles blocks whose linears are float8: the wrapper's checks
    trace without a graph break under grad and bf16 autocast (dynamo cannot trace the
    inference-mode query, which the wrapper asks only with grad off)."""
    block = plain_when_sampling(torch.nn.Sequential(Float8Linear(8, 8), torch.nn.SiLU(), Float8Linear(8, 8)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(block)(torch.randn(2, 8, requires_grad=True))
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
