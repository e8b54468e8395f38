"""LocalLearner.step on the built-in tiny models: micro-batch invariance of the update,
the non-finite guard, bf16 autocast, and the MoE router auxiliary loss."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

import fp32_bounds as fp32

from rltune.algos import ALGORITHMS, loss_denominator
from rltune.config.schema import AlgoConfig, TrainConfig
from rltune.data.collate import join
from rltune.data.records import TrainBatch
from rltune.learner.learner import LocalLearner, NonFiniteError, expert_load_metrics
from rltune.learner.microbatch import split_by_tokens
from rltune.learner.objectives import Objective, build_objective
from rltune.metrics.types import histograms, scalars
from rltune.models.logprobs import completion_logprobs

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
# (algorithm, aggregation): the three policy-loss aggregations and SFT (always token-mean)
OBJECTIVES = [("grpo", agg) for agg in AGGREGATIONS] + [("sft", "token-mean")]
ROWS = 8


def grpo_batch(model: torch.nn.Module, *, seed: int = 0) -> TrainBatch:
    """A GRPO-like batch: left-padded prompts of 2..11 tokens, completions of 1..13
    tokens, a random loss mask inside each completion (one row fully masked out, as a
    rollout without a reward is), per-sequence advantages expanded over tokens, and old
    log-probs that differ from the current ones by noise so the clip is active."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, 12, (ROWS,), generator=g).tolist()
    comp_lens = torch.randint(1, 14, (ROWS,), generator=g).tolist()
    prompts = [torch.randint(4, 260, (n,), generator=g) for n in prompt_lens]
    comps = [torch.randint(4, 260, (n,), generator=g) for n in comp_lens]
    input_ids, attention_mask, prompt_len = join(prompts, comps, 0)
    comp_mask = attention_mask[:, prompt_len:].float()
    loss_mask = (torch.rand(comp_mask.shape, generator=g) < 0.8).float() * comp_mask
    loss_mask[3] = 0.0
    advantages = torch.randn(ROWS, generator=g)[:, None].expand_as(loss_mask)
    with torch.no_grad():
        current = completion_logprobs(model, input_ids, attention_mask, prompt_len).logprobs
    old = (current + 0.3 * torch.randn(current.shape, generator=g)) * comp_mask
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention_mask, prompt_len=prompt_len,
        loss_mask=loss_mask, advantages=advantages, old_logprobs=old,
    )


def budget_for(batch: TrainBatch, chunks: int) -> int:
    """The smallest token budget for which ``split_by_tokens`` makes ``chunks`` micro-batches."""
    for budget in range(1, 10_000):
        if len(split_by_tokens(batch, budget)) == chunks:
            return budget
    raise AssertionError(f"no budget splits the batch into {chunks} micro-batches")


def make_learner(model: torch.nn.Module, algo: str, aggregation: str, **train) -> LocalLearner:
    cfg = TrainConfig(**{"lr": 1e-3, "grad_clip": None, **train})
    objective = build_objective(ALGORITHMS[algo], AlgoConfig(name=algo, aggregation=aggregation))
    return LocalLearner(model, objective, cfg)


def step_and_capture(learner: LocalLearner, batch: TrainBatch) -> tuple[dict, dict[str, torch.Tensor]]:
    """Run one step; also return the gradients exactly as the optimizer saw them
    (after accumulation and clipping)."""
    grads: dict[str, torch.Tensor] = {}

    def snapshot(*_args) -> None:
        grads.update({n: p.grad.clone() for n, p in learner.model.named_parameters()})

    handle = learner.optimizer.register_step_pre_hook(snapshot)
    metrics = scalars(learner.step(batch))
    handle.remove()
    return metrics, grads


@pytest.fixture(scope="module")
def batch(tiny_model: torch.nn.Module) -> TrainBatch:
    return grpo_batch(tiny_model)


# ---------------------------------------------------------------- micro-batch invariance

# Tolerances come from fp32_bounds.py (the derivation is there): gradients within 4 N u A
# per entry, the parameters after AdamW's first step within lr / eps times that (plus the
# update's own roundings). Adam's eps = 1e-3 keeps that slope at lr / eps = 1, so the
# parameter check is as tight as the gradient check while updates stay ~1e-4..1e-3 (with
# the default eps = 1e-8 the slope is 1e5 and a rounding-sized gradient difference could
# move a parameter by a whole update).
ADAM_EPS = 1e-3
LR = 1e-3


def run_split(
    model: torch.nn.Module, batch: TrainBatch, algo: str, aggregation: str,
    budget: int, grad_clip: float | None, objective: Objective | None = None,
) -> tuple[torch.nn.Module, dict, dict[str, torch.Tensor]]:
    """One step on a copy of ``model``: the copy, the metrics and the whole step's
    gradients before clipping (what the micro-batches accumulated)."""
    copy_ = copy.deepcopy(model)
    learner = make_learner(copy_, algo, aggregation, lr=LR, micro_batch_tokens=budget, grad_clip=grad_clip)
    if objective is not None:
        learner.objective = objective
    for group in learner.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    grads = fp32.capture_grads(copy_)
    return copy_, scalars(learner.step(batch)), grads


@torch.no_grad()
def loss_scale(model: torch.nn.Module, objective: Objective, batch: TrainBatch) -> float:
    """The loss's "sum of |terms|" (fp32_bounds.py): the loss with every advantage made
    negative. A token's policy loss is ``-A min(r, clip r)`` for ``A > 0`` and ``|A| max(r,
    clip r)`` for ``A < 0``, so with ``A -> -|A|`` every term is positive and at least the
    magnitude it had, weighed by the same aggregation (SFT's and the KL's terms are >= 0)."""
    negative = dataclasses.replace(batch, advantages=-batch.advantages.abs())
    out = objective.forward(model, negative, temperature=1.0, router_logits=False)
    return float(objective.loss(out, negative, objective.denominator(negative))[0])


class Whole:
    """The step on the whole batch, and how far any other fp32 computation of it may be."""

    def __init__(self, model: torch.nn.Module, batch: TrainBatch, algo: str, aggregation: str,
                 grad_clip: float | None, objective: Objective | None = None) -> None:
        self.model, self.metrics, self.grads = run_split(model, batch, algo, aggregation, 10_000, grad_clip, objective)
        objective = objective or make_learner(copy.deepcopy(model), algo, aggregation).objective
        self.grad_tol = fp32.gradient_tolerance(fp32.gradient_scales(copy.deepcopy(model), objective, batch), batch)
        self.param_tol = fp32.update_tolerance(fp32.params(model), self.grads, self.grad_tol,
                                               lr=LR, eps=ADAM_EPS, clip=grad_clip)
        positions = batch.input_ids.numel()
        # the loss: a sum over N positions of terms rounded like the gradients' (4 N u of
        # its sum of |terms|, as for an entry of a gradient)
        self.loss_tol = 4 * positions * fp32.U * loss_scale(model, objective, batch)
        # the norm: | |g1| - |g2| | <= |g1 - g2|, plus each side's rounding of a sum of n
        # squares (all >= 0: (n - 1) u relative) over the largest tensor, then over the
        # tensors, halved by the square root; once per side
        grad_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in self.grads.values()))
        tol_norm = torch.sqrt(sum((t.double() ** 2).sum() for t in self.grad_tol.values()))
        n = max(g.numel() for g in self.grads.values()) + len(self.grads)
        self.grad_norm_rel = float(tol_norm / grad_norm) + n * fp32.U

    def assert_same_update(self, model: torch.nn.Module, metrics: dict, grads: dict[str, torch.Tensor]) -> None:
        fp32.assert_within(grads, self.grads, self.grad_tol, "gradients")
        fp32.assert_within(fp32.params(model), fp32.params(self.model), self.param_tol, "parameters")
        assert abs(metrics["loss"] - self.metrics["loss"]) <= self.loss_tol
        assert metrics["grad_norm"] == pytest.approx(self.metrics["grad_norm"], rel=self.grad_norm_rel)


def test_budgets_really_split_into_two_and_four(batch: TrainBatch) -> None:
    assert len(split_by_tokens(batch, 10_000)) == 1
    assert len(split_by_tokens(batch, budget_for(batch, 2))) == 2
    assert len(split_by_tokens(batch, budget_for(batch, 4))) == 4


@pytest.mark.parametrize("grad_clip", [None, 0.05], ids=["no-clip", "clip"])
@pytest.mark.parametrize(("algo", "aggregation"), OBJECTIVES)
def test_update_does_not_depend_on_micro_batching(
    tiny_model: torch.nn.Module, batch: TrainBatch, algo: str, aggregation: str,
    grad_clip: float | None,
) -> None:
    whole = Whole(tiny_model, batch, algo, aggregation, grad_clip)
    if grad_clip is not None:
        assert whole.metrics["grad_norm"] > 10 * grad_clip  # the clip is really active
    # the step moves weights by far more than the tolerance: the check can tell them apart
    assert fp32.worst_excess(fp32.params(whole.model), fp32.params(tiny_model), whole.param_tol)[0] > 10
    for chunks in (2, 4):
        model, metrics, grads = run_split(tiny_model, batch, algo, aggregation, budget_for(batch, chunks), grad_clip)
        whole.assert_same_update(model, metrics, grads)
        assert metrics["tokens"] == whole.metrics["tokens"] == float(batch.loss_mask.sum())


def _own_tokens(right: Objective) -> Objective:
    """Each micro-batch normalised by its own token count instead of the whole batch's."""
    return dataclasses.replace(right, loss=lambda out, mb, _den: right.loss(out, mb, loss_denominator(mb.loss_mask)))



@pytest.mark.parametrize("mistake", [_own_tokens, fp32.first_twice], ids=["own-denominator", "counted-twice"])
def test_micro_batch_invariance_check_can_fail(tiny_model: torch.nn.Module, batch: TrainBatch, mistake) -> None:
    """Control: a real accumulation mistake moves the gradients and the update by many
    times the derived tolerances above."""
    right = build_objective(ALGORITHMS["grpo"], AlgoConfig(aggregation="token-mean"))
    whole = Whole(tiny_model, batch, "grpo", "token-mean", None, right)
    model, metrics, grads = run_split(tiny_model, batch, "grpo", "token-mean", budget_for(batch, 4), None,
                                      mistake(right))
    with pytest.raises(AssertionError, match="times the derived tolerance"):
        whole.assert_same_update(model, metrics, grads)
    assert fp32.worst_excess(grads, whole.grads, whole.grad_tol)[0] > 100
    assert fp32.worst_excess(fp32.params(model), fp32.params(whole.model), whole.param_tol)[0] > 10


# ---------------------------------------------------------------- non-finite guard


def snapshot_state(learner: LocalLearner) -> tuple[list[torch.Tensor], dict]:
    params = [p.detach().clone() for p in learner.model.parameters()]
    return params, copy.deepcopy(learner.optimizer.state_dict())


def assert_state_unchanged(learner: LocalLearner, before: tuple[list[torch.Tensor], dict]) -> None:
    params, opt_state = before
    for p, q in zip(learner.model.parameters(), params):
        assert torch.equal(p, q)  # bitwise
    now = learner.optimizer.state_dict()
    assert now["state"].keys() == opt_state["state"].keys()
    for key, state in opt_state["state"].items():
        for name, value in state.items():
            assert torch.equal(now["state"][key][name], value), (key, name)
    assert all(p.grad is None for p in learner.model.parameters())


def with_advantage(batch: TrainBatch, value: float) -> TrainBatch:
    bad = copy.copy(batch)
    bad.advantages = batch.advantages.clone()
    row = int(batch.loss_mask.sum(dim=1).argmax())
    bad.advantages[row] = value
    return bad


@pytest.mark.parametrize("grad_clip", [None, 1.0], ids=["no-clip", "clip"])
def test_nan_gradient_skips_the_step(tiny_model: torch.nn.Module, batch: TrainBatch, grad_clip) -> None:
    learner = make_learner(copy.deepcopy(tiny_model), "grpo", "token-mean", grad_clip=grad_clip)
    learner.step(batch)  # a finite step first, so the optimizer has state to protect
    assert learner.version == 1
    before = snapshot_state(learner)
    lr_step = learner.schedule.last_epoch
    param = learner.model.get_parameter("model.layers.0.self_attn.q_proj.weight")
    handle = param.register_hook(lambda g: torch.full_like(g, float("nan")))
    metrics = scalars(learner.step(batch))
    handle.remove()
    assert metrics["skipped"] == 1.0
    assert not math.isfinite(metrics["grad_norm"])
    assert metrics["nonfinite_total"] == 1.0
    assert learner.version == 1
    assert learner.schedule.last_epoch == lr_step
    assert_state_unchanged(learner, before)
    # the next finite step goes through
    assert scalars(learner.step(batch))["skipped"] == 0.0
    assert learner.version == 2


def test_infinite_advantage_skips_the_step(tiny_model: torch.nn.Module, batch: TrainBatch) -> None:
    learner = make_learner(copy.deepcopy(tiny_model), "grpo", "seq-mean-token-mean")
    before = snapshot_state(learner)
    metrics = scalars(learner.step(with_advantage(batch, float("inf"))))
    assert metrics["skipped"] == 1.0
    assert learner.version == 0
    assert_state_unchanged(learner, before)


def test_consecutive_nonfinite_steps_raise_and_finite_step_resets(
    tiny_model: torch.nn.Module, batch: TrainBatch
) -> None:
    learner = make_learner(copy.deepcopy(tiny_model), "grpo", "token-mean", max_nonfinite_steps=3)
    bad = with_advantage(batch, float("inf"))
    for _ in range(2):
        assert scalars(learner.step(bad))["skipped"] == 1.0
    # a finite step in between resets the count: two more bad steps are still allowed
    assert scalars(learner.step(batch))["skipped"] == 0.0
    for _ in range(2):
        assert scalars(learner.step(bad))["skipped"] == 1.0
    with pytest.raises(NonFiniteError, match=r"train\.lr.*train\.grad_clip"):
        learner.step(bad)
    assert learner.nonfinite_total == 5
    assert learner.version == 1


# ---------------------------------------------------------------- bf16


def test_bf16_autocast_update_is_close_to_fp32(tiny_model: torch.nn.Module, batch: TrainBatch) -> None:
    results = {}
    for precision in ("fp32", "bf16"):
        model = copy.deepcopy(tiny_model)
        learner = make_learner(model, "grpo", "token-mean", precision=precision)
        seen: list[torch.dtype] = []
        hook = model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        metrics, grads = step_and_capture(learner, batch)
        hook.remove()
        update = torch.cat([(p - q).detach().flatten() for p, q in zip(model.parameters(), tiny_model.parameters())])
        results[precision] = (seen[0], metrics, torch.cat([g.flatten() for g in grads.values()]), update, model)
    dtype32, m32, g32, u32, _ = results["fp32"]
    dtype16, m16, g16, u16, model16 = results["bf16"]
    assert (dtype32, dtype16) == (torch.float32, torch.bfloat16)  # autocast really ran
    assert all(p.dtype == torch.float32 for p in model16.parameters())  # master weights stay fp32
    # bf16 keeps 8 mantissa bits (relative rounding ~4e-3 per op), so after a 4-layer
    # forward and backward the gradient is expected within a few percent of fp32, yet not
    # equal to it (which would mean autocast did nothing).
    rel = float((g16 - g32).norm() / g32.norm())
    assert 1e-4 < rel < 0.03
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.01)
    assert m16["entropy"] == pytest.approx(m32["entropy"], abs=1e-2)
    # Adam's first step is ~lr * sign(g): only components whose gradient is near 0 can flip
    cosine = float(torch.nn.functional.cosine_similarity(u16, u32, dim=0))
    assert cosine > 0.98


# ---------------------------------------------------------------- MoE router aux loss


def test_moe_aux_loss_reaches_the_router(tiny_moe_model: torch.nn.Module, batch: TrainBatch) -> None:
    grads, metrics = {}, {}
    for coef in (0.0, 1.0):
        model = copy.deepcopy(tiny_moe_model)
        objective = build_objective(ALGORITHMS["grpo"], AlgoConfig())
        learner = LocalLearner(model, objective, TrainConfig(lr=1e-3, grad_clip=None), aux_loss_coef=coef)
        metrics[coef], grads[coef] = step_and_capture(learner, batch)
    assert "aux_loss" not in metrics[0.0]
    assert "aux_loss" in metrics[1.0]
    # independent: the router loss of the untouched model and its gradient alone
    model = copy.deepcopy(tiny_moe_model).train()
    out = completion_logprobs(
        model, batch.input_ids, batch.attention_mask, batch.prompt_len, output_router_logits=True
    )
    names = [n for n, _ in model.named_parameters()]
    aux_grads = torch.autograd.grad(out.aux_loss, list(model.parameters()), allow_unused=True)
    assert metrics[1.0]["aux_loss"] == pytest.approx(float(out.aux_loss.detach()), rel=1e-5)
    routers = [n for n in names if n.endswith("mlp.gate.weight")]
    assert len(routers) == 2
    for name, aux in zip(names, aux_grads):
        diff = grads[1.0][name] - grads[0.0][name]
        expected = torch.zeros_like(diff) if aux is None else aux
        torch.testing.assert_close(diff, expected, rtol=1e-4, atol=1e-6, msg=name)
    for name in routers:
        assert float((grads[1.0][name] - grads[0.0][name]).abs().max()) > 1e-3


# ---------------------------------------------------------------- MoE expert load


def test_expert_load_metrics_by_hand() -> None:
    # two layers, four experts; layer 0 routes 6 of 8 choices to expert 0, layer 1 evenly
    load = torch.tensor([[6.0, 2.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    got = expert_load_metrics(load)
    # shares x 4 experts: layer 0 -> 3, 1, 0, 0; layer 1 -> 1, 1, 1, 1
    assert scalars(got) == {"moe/load_max": 3.0, "moe/load_min": 0.0,
                            "moe/load/e0": 2.0, "moe/load/e1": 1.0, "moe/load/e2": 0.5, "moe/load/e3": 0.5}
    assert histograms(got) == {"moe/expert_load": [3.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]}
    assert "moe/load/e0" not in expert_load_metrics(load, per_expert_up_to=3)


def test_an_moe_step_reports_its_expert_load(tiny_moe_model: torch.nn.Module, batch: TrainBatch,
                                             tiny_model: torch.nn.Module) -> None:
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig())
    learner = LocalLearner(copy.deepcopy(tiny_moe_model), objective, TrainConfig(lr=1e-3))
    typed = learner.step(batch)
    got = scalars(typed)
    per_expert = [got[f"moe/load/e{i}"] for i in range(4)]
    assert sum(per_expert) == pytest.approx(4.0)  # shares x E average to 1 in every layer
    assert got["moe/load_max"] >= max(per_expert) >= 1.0 >= min(per_expert) >= got["moe/load_min"]
    # the counts behind it: every attended token makes top-2 choices in each of 2 layers
    out = completion_logprobs(copy.deepcopy(tiny_moe_model), batch.input_ids, batch.attention_mask,
                              batch.prompt_len, output_router_logits=True)
    assert out.expert_load.shape == (2, 4)
    assert out.expert_load.sum(1).tolist() == [2.0 * float(batch.attention_mask.sum())] * 2
    dense = LocalLearner(copy.deepcopy(tiny_model), objective, TrainConfig(lr=1e-3))
    assert not any(k.startswith("moe/") for k in dense.step(batch))


# ---------------------------------------------------------------- metrics over micro-batches


def test_step_metrics_do_not_depend_on_micro_batching(tiny_model: torch.nn.Module, batch: TrainBatch) -> None:
    """Each metric combines by its own reduction: the loss parts add up over micro-batches,
    the largest ratio is the largest of any micro-batch (a mean of per-micro-batch maxima,
    which is what averaging every metric gave, is smaller), token counts add up."""
    batch = copy.copy(batch)
    batch.ref_logprobs = batch.old_logprobs - 0.1
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(kl_coef=0.5, kl_kind="k3"))
    _, split, _ = run_split(tiny_model, batch, "grpo", "token-mean", budget_for(batch, 4), None, objective)
    _, whole, _ = run_split(tiny_model, batch, "grpo", "token-mean", 10_000, None, objective)
    assert whole["loss"] == pytest.approx(whole["loss/policy"] + whole["loss/kl"], rel=1e-6)
    for name in ("loss", "loss/policy", "loss/kl", "ratio_max", "clip_frac", "kl", "entropy", "tokens"):
        assert split[name] == pytest.approx(whole[name], rel=1e-5, abs=1e-7), name
    # the ratio's maximum over the batch, by hand
    ratio = (completion_logprobs(tiny_model, batch.input_ids, batch.attention_mask, batch.prompt_len)
             .logprobs.detach() - batch.old_logprobs).exp()
    assert whole["ratio_max"] == pytest.approx(float(ratio[batch.loss_mask.bool()].max()), rel=1e-5)
