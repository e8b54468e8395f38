"""Preference objectives on the tiny models: losses equal to the pure losses on log-probs
and scores computed row by row without padding, micro-batch invariance of the update,
held-out evaluation by hand, and the reference cache's reuse and invalidation."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import fp32_bounds as fp32

from rltune.algos import bradley_terry_loss, dpo_loss, simpo_loss
from rltune.config.schema import AlgoConfig, TrainConfig
from rltune.data.collate import collate_pairs
from rltune.data.records import Prompt, TrainBatch
from rltune.learner import pair_scoring
from rltune.learner import preference as pref
from rltune.learner.learner import LocalLearner
from rltune.learner.microbatch import split_by_tokens
from rltune.learner.objectives import Objective
from rltune.learner.pair_scoring import (
    REFERENCE_FILE,
    evaluate_pairs,
    load_or_compute_reference,
    pair_batches,
    pairs_fingerprint,
    reference_seq_logps,
    weights_fingerprint,
)
from rltune.learner.preference import preference_method
from rltune.metrics.types import scalars
from rltune.models.reward_model import load_reward_model

PAIRS = 8
EOS = 3


def make_pairs(n: int = PAIRS, *, seed: int = 0) -> list[Prompt]:
    """Random pairs: prompts of 2..11 tokens, responses of 1..12 tokens then EOS."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    tokens = lambda k: torch.randint(4, 260, (k,), generator=g).tolist()
    out = []
    for i in range(n):
        prompt, chosen, rejected = tokens(rand(2, 12)), tokens(rand(1, 13)), tokens(rand(1, 13))
        out.append(Prompt(id=f"p{i}", text="unused", input_ids=prompt,
                          meta={"chosen_ids": chosen + [EOS], "rejected_ids": rejected + [EOS]}))
    return out


def unpadded_token_logps(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> list[float]:
    """Each completion token's log-prob, from the row run alone (no padding at all)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    return [float(logp[len(prompt) + j - 1, tok]) for j, tok in enumerate(completion)]


def unpadded_score(rm: torch.nn.Module, ids: list[int]) -> float:
    with torch.no_grad():
        return float(rm.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1] @ rm.score.weight[0])


@pytest.fixture(scope="module")
def pairs() -> list[Prompt]:
    return make_pairs()


@pytest.fixture(scope="module")
def ref(tiny_model, pairs) -> torch.Tensor:
    """Reference log-probs a little away from the model's own, so DPO's margins are not 0."""
    g = torch.Generator().manual_seed(1)
    return reference_seq_logps(tiny_model, pairs, 0, budget=10_000) + torch.randn(PAIRS, 2, generator=g)


@pytest.fixture(scope="module")
def tiny_rm(tiny_path: str) -> torch.nn.Module:
    return load_reward_model(tiny_path, seed=0)


# ---------------------------------------------------------------- losses by hand


def _sums(model, pairs: list[Prompt], *, mean: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    def one(p: Prompt, key: str) -> float:
        logps = unpadded_token_logps(model, p.input_ids, p.meta[key])
        return sum(logps) / (len(logps) if mean else 1)
    return (torch.tensor([one(p, "chosen_ids") for p in pairs], dtype=torch.float64),
            torch.tensor([one(p, "rejected_ids") for p in pairs], dtype=torch.float64))


def _objective_loss(model, objective: Objective, batch: TrainBatch) -> tuple[float, dict]:
    with torch.no_grad():
        out = objective.forward(model, batch, temperature=1.0, router_logits=False)
        loss, metrics = objective.loss(out, batch, objective.denominator(batch))
    return float(loss), metrics


@pytest.mark.parametrize("kind,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0),
                                            ("hinge", 0.0), ("robust", 0.1)])
def test_dpo_loss_on_hand_summed_logps(tiny_model, pairs, ref, kind, smoothing) -> None:
    cfg = AlgoConfig(name="dpo", beta=0.3, dpo_kind=kind, label_smoothing=smoothing)
    objective = preference_method("dpo").objective(cfg)
    got, metrics = _objective_loss(tiny_model, objective, collate_pairs(pairs, 0, ref))
    chosen, rejected = _sums(tiny_model, pairs)
    ref64 = ref.double()
    expected, exp_metrics = dpo_loss(chosen, rejected, ref64[:, 0], ref64[:, 1], beta=0.3, kind=kind,
                                     label_smoothing=smoothing)
    assert got == pytest.approx(float(expected), abs=2e-5)
    assert float(metrics["rewards/margin"]) == pytest.approx(float(exp_metrics["rewards/margin"]), abs=2e-5)
    assert float(metrics["logps/chosen"]) == pytest.approx(float(chosen.mean()), abs=2e-5)
    if kind == "sigmoid" and smoothing == 0.0:  # and DPO's own formula, written out
        h = [(c - rc) - (r - rr) for c, r, (rc, rr) in zip(chosen.tolist(), rejected.tolist(), ref64.tolist())]
        plain = sum(math.log1p(math.exp(-0.3 * x)) for x in h) / len(h)
        assert got == pytest.approx(plain, abs=2e-5)


def test_simpo_loss_on_hand_averaged_logps(tiny_model, pairs) -> None:
    cfg = AlgoConfig(name="simpo", beta=2.0, simpo_gamma=0.5)
    got, metrics = _objective_loss(tiny_model, preference_method("simpo").objective(cfg),
                                   collate_pairs(pairs, 0))
    chosen, rejected = _sums(tiny_model, pairs, mean=True)
    expected, _ = simpo_loss(chosen, rejected, beta=2.0, gamma=0.5)
    plain = sum(-math.log(1 / (1 + math.exp(-(2.0 * (c - r) - 0.5))))
                for c, r in zip(chosen.tolist(), rejected.tolist())) / PAIRS
    assert got == pytest.approx(float(expected), abs=2e-5)
    assert got == pytest.approx(plain, abs=2e-5)
    assert float(metrics["rewards/chosen"]) == pytest.approx(2.0 * float(chosen.mean()), abs=2e-5)


def test_reward_model_loss_on_unpadded_scores(tiny_rm, pairs) -> None:
    got, metrics = _objective_loss(tiny_rm, preference_method("reward_model").objective(AlgoConfig()),
                                   collate_pairs(pairs, 0))
    chosen = torch.tensor([unpadded_score(tiny_rm, p.input_ids + p.meta["chosen_ids"]) for p in pairs])
    rejected = torch.tensor([unpadded_score(tiny_rm, p.input_ids + p.meta["rejected_ids"]) for p in pairs])
    expected, exp_metrics = bradley_terry_loss(chosen, rejected)
    assert got == pytest.approx(float(expected), abs=2e-5)
    assert float(metrics["accuracy"]) == float(exp_metrics["accuracy"])
    assert 0 < float(exp_metrics["accuracy"]) < 1  # both kinds of pair are in the batch


def test_objectives_count_pairs() -> None:
    batch = collate_pairs(make_pairs(3), 0, torch.zeros(3, 2))
    for name in ("dpo", "simpo", "reward_model"):
        objective = preference_method(name).objective(AlgoConfig())
        assert objective.unit == 2
        assert float(objective.denominator(batch)) == 3.0
        assert float(objective.metric_weight(batch.select(slice(0, 4)))) == 2.0


def test_dpo_without_reference_says_how_to_get_it(tiny_model, pairs) -> None:
    objective = preference_method("dpo").objective(AlgoConfig(name="dpo"))
    with pytest.raises(ValueError, match=r"ref_seq_logps.*collate_pairs\(\.\.\., ref_logps=\)"):
        _objective_loss(tiny_model, objective, collate_pairs(pairs, 0))
    with pytest.raises(ValueError, match="does not learn from preference pairs"):
        preference_method("grpo")


def test_the_preference_methods_are_the_registrys_entries_that_learn_from_pairs(monkeypatch) -> None:
    from rltune.algos import ALGORITHMS, dpo_loss, sft_loss
    from rltune.algos.registry import offline_algorithm

    assert sorted(pref.PREFERENCE_METHODS) == sorted(k for k, a in ALGORITHMS.items() if a.pairs)
    assert [preference_method(n).needs_reference for n in ("dpo", "simpo", "reward_model")] == [True, False, False]
    # an entry registered later is a preference method at once, by its loss
    monkeypatch.setitem(ALGORITHMS, "dpo_again", offline_algorithm("dpo_again", dpo_loss, needs_reference=True, pairs=True))
    assert "dpo_again" in pref.PREFERENCE_METHODS
    assert preference_method("dpo_again") == preference_method("dpo")
    monkeypatch.setitem(ALGORITHMS, "odd_pairs", offline_algorithm("odd_pairs", sft_loss, pairs=True))
    with pytest.raises(ValueError, match="learns from pairs with sft_loss, which has no preference objective"):
        preference_method("odd_pairs")


# ---------------------------------------------------------------- micro-batch invariance

# Tolerances come from fp32_bounds.py (the derivation is there): gradients within 4 N u A
# per entry, the parameters after AdamW's first step within lr / eps times that. Adam's
# eps = 1e-2 keeps that slope at 0.1, so the parameter check is as tight as the gradient
# check while updates stay ~1e-4..1e-3 (with the default eps = 1e-8 the slope is 1e5 and a
# rounding-sized gradient difference could move a parameter by a whole update).
ADAM_EPS = 1e-2
LR = 1e-3


def budget_for(batch: TrainBatch, chunks: int) -> int:
    for budget in range(1, 10_000):
        if len(split_by_tokens(batch, budget, unit=2)) == chunks:
            return budget
    raise AssertionError(f"no budget splits the batch into {chunks} micro-batches")


def run_step(model, objective: Objective, batch: TrainBatch, budget: int, grad_clip):
    """One step on a copy of ``model``: the copy, the metrics and the whole step's
    gradients before clipping (what the micro-batches accumulated)."""
    model = copy.deepcopy(model)
    learner = LocalLearner(model, objective, TrainConfig(lr=LR, grad_clip=grad_clip, micro_batch_tokens=budget))
    for group in learner.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    grads = fp32.capture_grads(model)
    return model, scalars(learner.step(batch)), grads


@torch.no_grad()
def max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


# (method, its settings, grad clip): a clip of 0.05 is far below every gradient norm here
METHODS = [
    ("dpo", dict(beta=0.5), None), ("dpo", dict(beta=0.5), 0.05),
    ("dpo", dict(beta=0.5, dpo_kind="ipo"), None), ("simpo", {}, None),
    ("reward_model", {}, None), ("reward_model", {}, 0.05),
]


class Whole:
    """The step on the whole batch, and how far any other fp32 computation of it may be."""

    def __init__(self, model, objective: Objective, batch: TrainBatch, grad_clip) -> None:
        self.model, self.metrics, self.grads = run_step(model, objective, batch, 10_000, grad_clip)
        self.grad_tol = fp32.gradient_tolerance(fp32.gradient_scales(copy.deepcopy(model), objective, batch), batch)
        self.param_tol = fp32.update_tolerance(fp32.params(model), self.grads, self.grad_tol,
                                               lr=LR, eps=ADAM_EPS, clip=grad_clip)

    def assert_same_update(self, model, metrics, grads) -> None:
        fp32.assert_within(grads, self.grads, self.grad_tol, "gradients")
        fp32.assert_within(fp32.params(model), fp32.params(self.model), self.param_tol, "parameters")
        # the loss sums <= T = 24 positions per row and 8 pairs: (24 + 8) u per side
        # relative to its sum of |terms|, which is a few times |loss| here; 1e-5 = 168 u
        # (measured: at most 9 u apart on AVX-512, AVX2 and scalar kernels)
        assert metrics["loss"] == pytest.approx(self.metrics["loss"], rel=1e-5)


@pytest.mark.parametrize(("name", "kwargs", "grad_clip"), METHODS,
                         ids=["dpo", "dpo-clip", "ipo", "simpo", "rm", "rm-clip"])
def test_update_does_not_depend_on_micro_batching(tiny_model, tiny_rm, pairs, ref, name, kwargs, grad_clip) -> None:
    model = tiny_rm if name == "reward_model" else tiny_model
    objective = preference_method(name).objective(AlgoConfig(name=name, **kwargs))
    batch = collate_pairs(pairs, 0, ref)
    whole = Whole(model, objective, batch, grad_clip)
    if grad_clip is not None:
        assert whole.metrics["grad_norm"] > 10 * grad_clip
    # the step moves weights by far more than the tolerance: the check can tell them apart
    assert fp32.worst_excess(fp32.params(whole.model), fp32.params(model), whole.param_tol)[0] > 10
    for chunks in (2, 4):
        got_model, metrics, grads = run_step(model, objective, batch, budget_for(batch, chunks), grad_clip)
        whole.assert_same_update(got_model, metrics, grads)
        accuracy = "accuracy" if name == "reward_model" else "rewards/accuracy"
        # metrics are weighed by pairs: the step's accuracy is the whole batch's
        assert metrics[accuracy] == pytest.approx(whole.metrics[accuracy], abs=1e-6)


def _own_pairs(right: Objective) -> Objective:
    """Each micro-batch normalised by its own pair count instead of the whole batch's."""
    return dataclasses.replace(right, loss=lambda out, mb, _d: right.loss(out, mb, pref.pair_count(mb)))



@pytest.mark.parametrize("mistake", [_own_pairs, fp32.first_twice], ids=["own-denominator", "counted-twice"])
@pytest.mark.parametrize("name", ["dpo", "reward_model"])
def test_micro_batch_invariance_check_can_fail(tiny_model, tiny_rm, pairs, ref, name, mistake) -> None:
    """Control: a real accumulation mistake moves the gradients and the update by many
    times the derived tolerances above."""
    model = tiny_rm if name == "reward_model" else tiny_model
    right = preference_method(name).objective(AlgoConfig(name=name, beta=0.5))
    batch = collate_pairs(pairs, 0, ref)
    whole = Whole(model, right, batch, None)
    got_model, metrics, grads = run_step(model, mistake(right), batch, budget_for(batch, 4), None)
    with pytest.raises(AssertionError, match="times the derived tolerance"):
        whole.assert_same_update(got_model, metrics, grads)
    assert fp32.worst_excess(grads, whole.grads, whole.grad_tol)[0] > 100
    assert fp32.worst_excess(fp32.params(got_model), fp32.params(whole.model), whole.param_tol)[0] > 10


# ---------------------------------------------------------------- batching and evaluation


def test_pair_batches_cover_every_pair_once_within_budget(pairs) -> None:
    budget = 120
    seen = []
    for rows, batch in pair_batches(pairs, 0, budget=budget):
        assert len(batch) == 2 * len(rows)
        assert len(rows) == 1 or batch.input_ids.numel() <= budget
        for k, i in enumerate(rows):  # row 2k is pair i's chosen, in collate's layout
            expected = collate_pairs([pairs[i]], 0).trim()
            got = batch.select(slice(2 * k, 2 * k + 2)).trim()
            assert torch.equal(got.input_ids, expected.input_ids)
        seen += rows
    assert sorted(seen) == list(range(PAIRS))
    again = [rows for rows, _ in pair_batches(pairs, 0, budget=budget)]
    assert again == [rows for rows, _ in pair_batches(pairs, 0, budget=budget)]
    assert len(again) > 2


class _Reward:
    """A stand-in model whose 'reward' of a row is its first completion token id."""

    forward = staticmethod(lambda model, mb, **_: mb)
    rewards = staticmethod(lambda out, mb: out.input_ids[:, out.prompt_len].float())


def test_evaluate_pairs_by_hand() -> None:
    # margins: 10 - 4 = 6, 5 - 5 = 0 (a tie: wrong), 7 - 9 = -2, 20 - 1 = 19
    firsts = [(10, 4), (5, 5), (7, 9), (20, 1)]
    prompts = [Prompt(id=str(i), text="t", input_ids=[1, 2],
                      meta={"chosen_ids": [c, 11, EOS], "rejected_ids": [r, EOS]})
               for i, (c, r) in enumerate(firsts)]
    model = torch.nn.Linear(1, 1).train()
    got = evaluate_pairs(model, prompts, 0, forward=_Reward.forward, rewards=_Reward.rewards, budget=12)
    assert got == {"eval/pref/accuracy": 0.5, "eval/pref/margin": pytest.approx(23 / 4)}
    assert model.training


def test_dpo_evaluation_of_the_reference_itself_is_all_ties(tiny_model, pairs) -> None:
    """Evaluated in the same batches as the reference was computed, the untrained policy's
    implicit rewards are exactly 0: accuracy 0 (ties count as wrong), margin 0."""
    cfg = AlgoConfig(name="dpo")
    ref = reference_seq_logps(tiny_model, pairs, 0, budget=150)
    method = preference_method("dpo")
    got = evaluate_pairs(tiny_model, pairs, 0, forward=method.objective(cfg).forward,
                         rewards=method.rewards(cfg), budget=150, ref_logps=ref)
    assert got == {"eval/pref/accuracy": 0.0, "eval/pref/margin": 0.0}


# ---------------------------------------------------------------- the reference cache


def test_reference_logps_equal_unpadded_sums(tiny_model, pairs) -> None:
    model = copy.deepcopy(tiny_model).train()
    got = reference_seq_logps(model, pairs, 0, budget=100)
    chosen, rejected = _sums(tiny_model, pairs)
    torch.testing.assert_close(got.double(), torch.stack([chosen, rejected], 1), rtol=0, atol=2e-5)
    assert got.dtype == torch.float32 and model.training
    assert all(p.grad is None for p in model.parameters())


def test_reference_context_is_entered(tiny_model, pairs) -> None:
    """The factory's context decides what the reference is: here, the model with its final
    norm scaled, undone on exit."""
    entered = []

    @contextlib.contextmanager
    def scaled_norm(model):
        entered.append(model)
        with torch.no_grad():
            model.model.norm.weight.mul_(2.0)
        try:
            yield
        finally:
            with torch.no_grad():
                model.model.norm.weight.div_(2.0)

    model = copy.deepcopy(tiny_model)
    got = reference_seq_logps(model, pairs, 0, budget=10_000, context=scaled_norm)
    assert entered == [model]
    assert max_abs_diff(model, tiny_model) == 0.0
    scaled = copy.deepcopy(tiny_model)
    with torch.no_grad():
        scaled.model.norm.weight.mul_(2.0)
    torch.testing.assert_close(got, reference_seq_logps(scaled, pairs, 0, budget=10_000))
    assert float((got - reference_seq_logps(model, pairs, 0, budget=10_000)).abs().max()) > 0.1


def test_cache_is_reused_for_the_same_data_and_model(tmp_path, tiny_model, pairs, monkeypatch) -> None:
    path = tmp_path / REFERENCE_FILE
    first = load_or_compute_reference(path, tiny_model, {"train": pairs, "eval": pairs[:3]}, 0, budget=200)
    assert not first.reused and path.is_file()
    torch.testing.assert_close(first.splits["eval"], first.splits["train"][:3], rtol=0, atol=1e-5)

    def no_compute(*args, **kwargs):
        raise AssertionError("recomputed although the cache fits")

    monkeypatch.setattr(pair_scoring, "reference_seq_logps", no_compute)
    # a resumed run: the same data (freshly loaded) and a fresh copy of the same model
    again = load_or_compute_reference(path, copy.deepcopy(tiny_model),
                                      {"train": copy.deepcopy(pairs), "eval": pairs[:3]}, 0, budget=999)
    assert again.reused and again.fingerprint == first.fingerprint
    for name in ("train", "eval"):
        assert torch.equal(again.splits[name], first.splits[name])


def _changed_token(pairs: list[Prompt]) -> list[Prompt]:
    out = copy.deepcopy(pairs)
    out[5].meta["rejected_ids"][0] += 1
    return out


def _changed_weight(model: torch.nn.Module) -> torch.nn.Module:
    out = copy.deepcopy(model)
    with torch.no_grad():
        out.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-3
    return out


@pytest.mark.parametrize("change", ["data", "model", "splits"])
def test_cache_is_recomputed_when_data_or_model_change(tmp_path, tiny_model, pairs, change) -> None:
    path = tmp_path / REFERENCE_FILE
    first = load_or_compute_reference(path, tiny_model, {"train": pairs}, 0, budget=200)
    model, splits = tiny_model, {"train": pairs}
    if change == "data":
        splits = {"train": _changed_token(pairs)}
    elif change == "model":
        model = _changed_weight(tiny_model)
    else:
        splits = {"train": pairs, "eval": pairs[:2]}
    second = load_or_compute_reference(path, model, splits, 0, budget=200)
    assert not second.reused and second.fingerprint != first.fingerprint
    expected = {name: reference_seq_logps(model, ps, 0, budget=200) for name, ps in splits.items()}
    for name in splits:
        torch.testing.assert_close(second.splits[name], expected[name], rtol=0, atol=0)
    if change == "data":  # pair 5's rejected log-prob is the one that moved
        moved = (second.splits["train"] - first.splits["train"]).abs() > 1e-4
        assert moved.nonzero().tolist() == [[5, 1]]
    third = load_or_compute_reference(path, model, splits, 0, budget=200)  # the new file is reused
    assert third.reused


def test_fingerprints_see_every_token_and_weight(tiny_model, pairs) -> None:
    assert pairs_fingerprint(pairs) == pairs_fingerprint(copy.deepcopy(pairs))
    assert pairs_fingerprint(pairs) != pairs_fingerprint(_changed_token(pairs))
    assert pairs_fingerprint(pairs) != pairs_fingerprint(pairs[::-1])
    assert weights_fingerprint(tiny_model) == weights_fingerprint(copy.deepcopy(tiny_model))
    assert weights_fingerprint(tiny_model) != weights_fingerprint(_changed_weight(tiny_model))
