"""The learner-group tests' shared setup, and what each spawned rank runs (the processes
import this module by name, so it holds only importable top-level functions)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from rltune.algos import ALGORITHMS
from rltune.config.schema import AlgoConfig, TrainConfig
from rltune.data.collate import join
from rltune.data.records import TrainBatch
from rltune.learner.distributed import shard_batch
from rltune.learner.learner import LocalLearner
from rltune.learner.microbatch import split_by_tokens
from rltune.learner.objectives import build_objective
from rltune.learner.parallel import DDP, Parallelism, StepPlan, make_parallelism
from rltune.metrics.types import scalars
from rltune.models.load import load_model
from rltune.models.logprobs import completion_logprobs

ROWS = 8
LR = 1e-3
# Adam's eps as in tests/unit/learner/test_learner_step.py: with the default 1e-8 its
# slope at g~0 is lr/eps = 1e5 and rounding noise in near-zero gradient components would
# move parameters by ~1e-5; with 1e-3 the slope is <= 1 and parameters compare at 1e-6.
# The default eps is compared too, on the first step, against a bound derived per entry
# (tests/unit/learner/fp32_bounds.py: small_eps_update_tolerance).
ADAM_EPS = 1e-3
DEFAULT_EPS = 1e-8
GRAD_CLIP = 0.05
BUDGET = 30
"""Micro-batch token budget: the whole batch splits into several micro-batches, and the
two shards into different numbers of them (checked by the tests)."""


def algo_config() -> AlgoConfig:
    """GRPO, token-mean, with a k3 KL term in the loss (so ``loss/kl`` is a metric too)."""
    return AlgoConfig(name="grpo", aggregation="token-mean", kl_coef=0.5, kl_kind="k3")


def make_batch(model: torch.nn.Module, *, seed: int = 0) -> TrainBatch:
    """A GRPO-like batch of ``ROWS`` rows: left-padded prompts of 2..11 tokens,
    completions of 1..13, a random loss mask (row 2 fully masked out), per-sequence
    advantages, and old and reference log-probs near the model's own (so the clip and the
    KL term are active)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 260, (int(n),), generator=g) for n in torch.randint(2, 12, (ROWS,), generator=g)]
    comps = [torch.randint(4, 260, (int(n),), generator=g) for n in torch.randint(1, 14, (ROWS,), generator=g)]
    input_ids, attention_mask, prompt_len = join(prompts, comps, 0)
    comp_mask = attention_mask[:, prompt_len:].float()
    loss_mask = (torch.rand(comp_mask.shape, generator=g) < 0.8).float() * comp_mask
    loss_mask[2] = 0.0
    with torch.no_grad():
        current = completion_logprobs(model, input_ids, attention_mask, prompt_len).logprobs
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention_mask, prompt_len=prompt_len, loss_mask=loss_mask,
        advantages=torch.randn(ROWS, generator=g)[:, None].expand_as(loss_mask),
        old_logprobs=(current + 0.3 * torch.randn(current.shape, generator=g)) * comp_mask,
        ref_logprobs=(current + 0.1 * torch.randn(current.shape, generator=g)) * comp_mask,
    )


def make_learner(model: torch.nn.Module, parallelism: Parallelism | None = None, *,
                 eps: float = ADAM_EPS, budget: int = BUDGET) -> LocalLearner:
    """A learner with the tests' objective, clip and Adam ``eps``, and a micro-batch token
    ``budget``."""
    objective = build_objective(ALGORITHMS["grpo"], algo_config())
    cfg = TrainConfig(lr=LR, grad_clip=GRAD_CLIP, micro_batch_tokens=budget)
    learner = LocalLearner(model, objective, cfg, parallelism=parallelism)
    assert learner.optimizer.defaults["eps"] == DEFAULT_EPS  # what "default" means below
    for group in learner.optimizer.param_groups:
        group["eps"] = eps
    return learner


def train_two_steps(learner: LocalLearner, batch: TrainBatch) -> dict:
    """Two steps on ``batch``: the scalar metrics and full weights after each, then the
    log-probs of ``batch`` under the trained weights."""
    metrics, weights = [], []
    for _ in range(2):
        metrics.append(scalars(learner.step(batch)))
        weights.append({k: v.clone() for k, v in learner.export_weights().items()})
    return {"metrics": metrics, "weights": weights, "logprobs": learner.logprobs(batch),
            "version": learner.version}


class PerShardDenominator:
    """Control: DDP whose ranks normalise by their own shard's denominator while DDP
    averages the ranks' gradients: a mean of per-shard means, not the batch's mean."""

    def __init__(self) -> None:
        self.ddp = DDP()

    def __getattr__(self, name: str):
        return getattr(self.ddp, name)

    def agree(self, rows: int, forwards: int, denominator: torch.Tensor | None) -> StepPlan:
        return replace(self.ddp.agree(rows, forwards, denominator), denominator=denominator)


def one_step(learner: LocalLearner, shard: TrainBatch) -> dict:
    return {"metrics": scalars(learner.step(shard)), "weights": learner.export_weights()}


def group_run(model_dir: str, batch: TrainBatch) -> dict:
    """One rank, each learner from a freshly loaded model on this rank's shard of
    ``batch``: two steps with DDP and two with FSDP2; one step with each at Adam's
    default eps; one step of the control at either eps."""
    torch.set_num_threads(1)
    shard = shard_batch(batch, dist.get_rank(), dist.get_world_size())
    out: dict = {"micro_batches": len(split_by_tokens(shard, BUDGET))}
    for strategy in ("ddp", "fsdp2"):
        learner = make_learner(load_model(model_dir), make_parallelism(strategy))
        out[strategy] = train_two_steps(learner, shard)
        # rank r predicts r + 1 rows: the ranks run different numbers of row chunks
        out[strategy]["uneven_logprobs"] = learner.logprobs(shard.select(slice(0, dist.get_rank() + 1)))
        default_eps = make_learner(load_model(model_dir), make_parallelism(strategy), eps=DEFAULT_EPS)
        out[f"{strategy}_default_eps"] = one_step(default_eps, shard)
    out["local_denominator"] = one_step(make_learner(load_model(model_dir), PerShardDenominator()), shard)
    out["local_denominator_default_eps"] = one_step(
        make_learner(load_model(model_dir), PerShardDenominator(), eps=DEFAULT_EPS), shard)
    return out


def fail_on_rank_one() -> None:
    """Rank 1 raises while rank 0 waits for it in a collective."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()
