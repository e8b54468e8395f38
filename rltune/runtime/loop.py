"""The one training loop. Where the pieces run (this process, a Ray cluster) is decided by
whoever builds the :class:`Run`; the loop only calls the protocols.

One step::

    prompts ─► generate ─► score ─► make experience ─► learn ─► publish weights
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from rltune.algos import Algorithm
from rltune.config.schema import Config
from rltune.data.collate import collate_sft
from rltune.data.records import Prompt, Rollout, SamplingParams, TrainBatch
from rltune.data.sampler import PromptSampler
from rltune.metrics.sinks import ConsoleProgress, JsonlWriter
from rltune.runtime.evaluate import evaluate
from rltune.runtime.experience import grpo_experience, rollout_metrics
from rltune.runtime.state import restore, save


class Generator(Protocol):
    def generate(self, prompts: list[Prompt], params: SamplingParams, *, group_offset: int = 0) -> list[Rollout]: ...
    def load_weights(self, version: int, tensors: dict[str, torch.Tensor] | None = None) -> None: ...


class Scorer(Protocol):
    def score(self, prompts: dict[str, Prompt], rollouts: list[Rollout]) -> Any: ...


class Learner(Protocol):
    version: int
    def step(self, batch: TrainBatch) -> dict[str, float]: ...
    def export_weights(self) -> dict[str, torch.Tensor]: ...


@dataclass
class Run:
    """Everything one training run holds; built by a runtime (``runtime/local.py``)."""

    cfg: Config
    algorithm: Algorithm
    run_dir: Path
    generator: Generator
    scorer: Scorer | None
    learner: Learner
    sampler: PromptSampler
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt] | None
    pad_id: int
    tokenizer: Any
    shared_weights: bool
    """The generator runs on the learner's own module (no copy to publish)."""
    data_warnings: list[str] = field(default_factory=list)
    """Bad rows skipped under ``data.on_bad_row: skip``, one line per data source."""
    reference_logprobs: Any = None
    """``(TrainBatch) -> [B, C]`` log-probs under the frozen reference, when one is loaded."""
    state: Any = None
    """What a checkpoint restores besides the model: see ``runtime/state.py``."""
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


def train(run: Run, *, stop_after: int | None = None) -> list[dict[str, float]]:
    """Run from the current step (0, or where a checkpoint left off) to ``train.steps``,
    or stop early after step ``stop_after`` with a checkpoint, as a preempted run would.
    Returns the metrics of every step run in this call."""
    cfg = run.cfg
    resumed = restore(run)
    metrics_log = JsonlWriter(run.run_dir / "metrics.jsonl", resume_after_step=run.step if resumed else None)
    samples_log = JsonlWriter(run.run_dir / "samples.jsonl", resume_after_step=run.step if resumed else None)
    with ConsoleProgress(cfg.train.steps, start=run.step, enabled=cfg.log.console) as bar:
        for warning in run.data_warnings:
            bar.print(warning)
        if run.step == 0 and run.eval_prompts:
            _log_eval(run, bar, metrics_log)
        last = cfg.train.steps if stop_after is None else min(stop_after, cfg.train.steps)
        while run.step < last:
            run.step += 1
            metrics = train_step(run, samples_log)
            if cfg.eval.every and run.step % cfg.eval.every == 0 and run.step < cfg.train.steps:
                metrics.update(_eval_metrics(run, bar))
            metrics_log.write({"step": run.step, **metrics})
            run.history.append(metrics)
            bar.update(run.step, metrics)
            if cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0:
                save(run)
        ran = bool(run.history)  # a run resumed from its final checkpoint has nothing left to do
        if ran and run.eval_prompts and run.step == cfg.train.steps:
            _log_eval(run, bar, metrics_log)
    if ran and not (cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0):
        save(run)
    metrics_log.close()
    samples_log.close()
    return run.history


def train_step(run: Run, samples_log: JsonlWriter) -> dict[str, float]:
    """One step: draw prompts, make a batch (generating and scoring when the algorithm is
    online), learn on it, publish the new weights."""
    cfg = run.cfg
    clock = _Clock()
    prompts = [run.train_prompts[i] for i in run.sampler.next_batch(cfg.train.prompts_per_step)]
    metrics: dict[str, float] = {}
    if run.algorithm.online:
        params = SamplingParams(
            n=cfg.algo.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k, stop=cfg.rollout.stop,
        )
        rollouts = run.generator.generate(prompts, params)
        clock.mark("generate")
        run.scorer.score({p.id: p for p in prompts}, rollouts)
        clock.mark("score")
        batch = grpo_experience(
            rollouts, group_size=cfg.algo.group_size, adv_scale=cfg.algo.adv_scale, pad_id=run.pad_id
        )
        if run.reference_logprobs is not None:
            batch.ref_logprobs = run.reference_logprobs(batch)
            clock.mark("reference")
        metrics.update(rollout_metrics(rollouts, cfg.algo.group_size))
        _write_samples(samples_log, run.step, prompts, rollouts, cfg.log.samples_per_step)
    else:
        batch = collate_sft(prompts, run.pad_id)
    metrics.update(run.learner.step(batch))
    clock.mark("learn")
    run.generator.load_weights(
        run.learner.version, None if run.shared_weights else run.learner.export_weights()
    )
    clock.mark("sync")
    metrics.update(clock.metrics())
    metrics["policy_version"] = float(run.learner.version)
    metrics["samples_per_s"] = len(batch) / metrics["time/step"]
    return metrics


def _eval_metrics(run: Run, bar: ConsoleProgress) -> dict[str, float]:
    cfg = run.cfg
    metrics = evaluate(
        run.generator, run.scorer, run.eval_prompts,
        max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
        temperature=cfg.eval.temperature, batch_size=cfg.eval.batch_size,
        max_prompts=cfg.eval.max_prompts, stop=cfg.rollout.stop,
    )
    skip = {"eval/reward/std", "eval/reward/errors"}
    shown = "  ".join(
        f"{k[len('eval/reward/'):]} {v:.3f}" for k, v in metrics.items()
        if k.startswith("eval/reward/") and k not in skip
    )
    bar.print(f"eval at step {run.step}: {shown}  (errors {metrics['eval/reward/errors']:.0f})")
    return metrics


def _log_eval(run: Run, bar: ConsoleProgress, log: JsonlWriter) -> None:
    log.write({"step": run.step, **_eval_metrics(run, bar)})


def _write_samples(
    log: JsonlWriter, step: int, prompts: list[Prompt], rollouts: list[Rollout], limit: int | None
) -> None:
    by_id = {p.id: p for p in prompts}
    for r in rollouts[:limit] if limit is not None else rollouts:
        prompt = by_id[r.prompt_id]
        log.write({
            "step": step,
            "prompt_id": r.prompt_id,
            "prompt": prompt.text if prompt.text is not None else prompt.messages,
            "completion": r.text,
            "reward": r.reward,
            "rewards": r.rewards,
            "reward_error": r.reward_error,
            "finish_reason": r.finish_reason,
            "length": len(r.completion_ids),
            "policy_version": r.policy_version,
        })


class _Clock:
    """Wall time of the phases of one step."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self.last
        self.last = now

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.phases.items()}
        out["time/step"] = self.last - self.start
        return out
