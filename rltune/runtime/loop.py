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
from rich.markup import escape

from rltune.algos import Algorithm, groups_with_spread, overlong_penalty
from rltune.config.schema import Config
from rltune.data.records import Prompt, Rollout, SamplingParams, TrainBatch
from rltune.data.sampler import PromptSampler
from rltune.metrics.sinks import ConsoleProgress, JsonlWriter
from rltune.metrics.types import Aggregator, Last, Max, Metric, MetricLike, Sum
from rltune.rewards.scorer import ScoreStats
from rltune.runtime.evaluate import evaluate
from rltune.runtime.experience import make_experience, rewards_tensor, rollout_metrics
from rltune.runtime.reward_errors import RewardErrorLimit, RewardErrorWatch
from rltune.runtime.rollouts import AsyncRollouts
from rltune.runtime.sinks import MetricSinks, open_sinks
from rltune.runtime.state import restore, save


class Generator(Protocol):
    def generate(self, prompts: list[Prompt], params: SamplingParams, *, group_offset: int = 0) -> list[Rollout]: ...
    def load_weights(self, version: int, tensors: dict[str, torch.Tensor] | None = None) -> None: ...


class Scorer(Protocol):
    def score(self, prompts: dict[str, Prompt], rollouts: list[Rollout]) -> ScoreStats: ...


class Learner(Protocol):
    version: int
    def step(self, batch: TrainBatch) -> dict[str, MetricLike]: ...
    def logprobs(self, batch: TrainBatch) -> torch.Tensor: ...
    def export_weights(self) -> dict[str, torch.Tensor]: ...


@dataclass
class Run:
    """Everything one training run holds; built by a runtime (``runtime/local.py``)."""

    cfg: Config
    algorithm: Algorithm
    run_dir: Path
    generator: Generator | None
    """None for runs that never generate (preference methods)."""
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
    notes: list[str] = field(default_factory=list)
    """Lines for the console when training starts (an old run moved aside, ...)."""
    reference_logprobs: Any = None
    """``(TrainBatch) -> [B, C]`` log-probs under the frozen reference, when one is loaded."""
    critic: Any = None
    """PPO's value learner: ``step(batch)``, ``values(batch) -> [B, C]``."""
    kl: Any = None
    """The KL coefficient of ``algo.kl_in_reward``: ``coef``, ``observe(kl, n)`` (runtime/kl.py)."""
    collate: Any = None
    """Offline algorithms: ``(prompts) -> TrainBatch``."""
    evaluate_model: Any = None
    """``(learner) -> metrics`` on the held-out split, for runs not judged by generating
    (preference methods); None evaluates by generating and scoring ``eval_prompts``."""
    state: Any = None
    """What a checkpoint restores besides the model: see ``runtime/state.py``."""
    rollouts: Any = None
    """With ``runtime.max_staleness > 0``: the producer generating ahead of the learner
    (:class:`rltune.runtime.rollouts.AsyncRollouts`); None generates in turn."""
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


def train(run: Run, *, stop_after: int | None = None) -> list[dict[str, float]]:
    """Run from the current step (0, or where a checkpoint left off) to ``train.steps``,
    or stop early after step ``stop_after`` with a checkpoint, as a preempted run would.
    Returns the metrics of every step run in this call."""
    cfg = run.cfg
    restored = restore(run)
    resume_after = run.step if restored else None
    notes = [*run.notes, *restored.lines(cfg.train.steps)]
    samples_log = JsonlWriter(run.run_dir / "samples.jsonl", resume_after_step=resume_after)
    metrics_log = open_sinks(cfg, run.run_dir, resume_after_step=resume_after)
    stopped: RewardErrorLimit | None = None
    try:
        ran = _train_steps(run, stop_after, metrics_log, samples_log, notes)
    except RewardErrorLimit as err:  # what the steps before learned is kept, as at the end
        ran, stopped = True, err
    finally:
        if run.rollouts is not None:
            run.rollouts.close()
        samples_log.close()
    if ran and not (cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0):
        save(run)
    if stopped is not None:
        raise stopped
    return run.history


def _train_steps(
    run: Run, stop_after: int | None, metrics_log: MetricSinks, samples_log: JsonlWriter, notes: list[str]
) -> bool:
    """The steps of :func:`train`, with the evaluations before and after; returns whether
    any step ran. ``notes`` are printed first (what was resumed or moved aside)."""
    cfg = run.cfg
    with metrics_log, ConsoleProgress(cfg.train.steps, start=run.step, enabled=cfg.log.console) as bar:
        for note in notes:
            bar.print(escape(note))
        for warning in run.data_warnings:
            bar.print(warning)
        if run.step == 0 and run.eval_prompts:
            _log_eval(run, bar, metrics_log)
        last = cfg.train.steps if stop_after is None else min(stop_after, cfg.train.steps)
        watch = RewardErrorWatch(cfg.train.max_reward_error_steps, bar.print)
        while run.step < last:
            run.step += 1
            typed = train_step(run, samples_log, watch=watch)
            if cfg.eval.every and run.step % cfg.eval.every == 0 and run.step < cfg.train.steps:
                typed.update(_eval_metrics(run, bar))
            metrics = metrics_log.log(run.step, typed)
            run.history.append(metrics)
            bar.update(run.step, metrics)
            if cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0:
                save(run)
            watch.check()
        ran = bool(run.history)  # a run resumed from its final checkpoint has nothing left to do
        if ran and run.eval_prompts and run.step == cfg.train.steps:
            _log_eval(run, bar, metrics_log)
    return ran


def train_step(run: Run, samples_log: JsonlWriter, *, watch: RewardErrorWatch | None = None) -> dict[str, Metric]:
    """One step: draw prompts, make a batch (generating and scoring when the algorithm is
    online), learn on it, publish the new weights. Returns the step's metrics, typed.
    ``watch`` is shown the step's rollouts (reward errors on the console)."""
    cfg = run.cfg
    clock = _Clock()
    metrics = Aggregator()
    generated_tokens = 0
    if run.rollouts is not None:
        prompts, rollouts, produced, waited = run.rollouts.take(run.learner.version)
        metrics.add(produced)
        clock.mark("wait")
    elif run.algorithm.online:
        prompts, rollouts = collect_rollouts(run, _draw(run, cfg.train.prompts_per_step), clock, metrics)
    else:
        prompts = _draw(run, cfg.train.prompts_per_step)
    if run.algorithm.online:
        batch, made = make_experience(run, rollouts)
        metrics.add(made)
        clock.mark("experience")
        accuracy = getattr(run.scorer, "accuracy_names", ())
        metrics.add(rollout_metrics(rollouts, cfg.algo.group_size, accuracy=accuracy))
        metrics.add(staleness_metrics(rollouts, run.learner.version))
        generated_tokens = sum(len(r.completion_ids) for r in rollouts)
        _write_samples(samples_log, run.step, prompts, rollouts, cfg.log.samples_per_step)
        if watch is not None:
            watch.observe(run.step, rollouts)
    else:
        batch = run.collate(prompts)
    metrics.add(learn(run, batch))
    clock.mark("learn")
    if run.rollouts is not None:
        run.rollouts.publish(run.learner.version, run.learner.export_weights())
        clock.mark("sync")
    elif run.generator is not None:
        run.generator.load_weights(
            run.learner.version, None if run.shared_weights else run.learner.export_weights()
        )
        clock.mark("sync")
    for part in (run.generator, run.scorer, run.learner):
        # runtimes whose parts can fail and be replaced report it here (restarts, sync time)
        extra = getattr(part, "step_metrics", None)
        if extra is not None:
            metrics.add(extra())
    times = clock.metrics()
    if run.rollouts is not None:  # the producer's own generate/score times are in metrics
        metrics.add({"async/learner_idle_frac": waited / times["time/step"]})
    metrics.add(times)
    step_s = times["time/step"]
    metrics.add({
        "policy_version": Last(float(run.learner.version)),
        "samples_per_s": len(batch) / step_s,
        # generated tokens when the step generates, else the tokens learned on
        "tokens_per_s": (generated_tokens or float(batch.loss_mask.sum())) / step_s,
    })
    return metrics.result()


def staleness_metrics(rollouts: list[Rollout], learner_version: int) -> dict[str, Metric]:
    """How many policy versions behind the learner the step's samples were generated:
    ``staleness/mean`` and ``staleness/max`` (0 when generation waits for every update)."""
    if not rollouts:
        return {}
    lags = [learner_version - r.policy_version for r in rollouts]
    return {"staleness/mean": sum(lags) / len(lags), "staleness/max": Max(float(max(lags)))}


def rollouts_ahead(run: Run, max_staleness: int) -> AsyncRollouts:
    """A producer generating and scoring the batches of the next steps while the learner
    learns (``runtime.max_staleness``); the generator must hold its own weights."""
    if run.shared_weights:
        raise ValueError("rollouts ahead of the learner need a generator with its own weights")
    ahead = AsyncRollouts(
        max_staleness=max_staleness, prompts_per_step=run.cfg.train.prompts_per_step,
        draw=lambda n: _draw(run, n),
        collect=lambda prompts, metrics, clock: collect_rollouts(
            run, prompts, clock, metrics, draw=ahead.draw_locked),
        load_weights=run.generator.load_weights, clock=_Clock, version=run.learner.version,
    )
    return ahead


def _draw(run: Run, n: int) -> list[Prompt]:
    return [run.train_prompts[i] for i in run.sampler.next_batch(n)]


def collect_rollouts(
    run: Run, prompts: list[Prompt], clock: "_Clock", metrics: Aggregator,
    draw: Any = None,
) -> tuple[list[Prompt], list[Rollout]]:
    """Generate and score ``group_size`` samples per prompt.

    With ``algo.dynamic_sampling`` (DAPO) groups whose valid rewards are all equal carry no
    signal and are dropped; more prompts are drawn and generated, up to
    ``algo.max_refill_rounds`` extra rounds, until ``train.prompts_per_step`` groups are
    kept (the surplus of the last round is dropped too). The step then learns on the
    groups it has, which may be fewer. ``draw(n)`` draws the refill prompts (default: the
    run's sampler).
    """
    cfg = run.cfg
    params = SamplingParams(
        n=cfg.algo.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k, stop=cfg.rollout.stop,
    )
    rollouts = _generate_and_score(run, prompts, params, clock, metrics, group_offset=0)
    if not cfg.algo.dynamic_sampling:
        return prompts, rollouts
    wanted, group = len(prompts), cfg.algo.group_size
    drawn, rounds = len(prompts), 0
    kept_prompts, kept = _groups_with_signal(prompts, rollouts, group)
    while len(kept_prompts) < wanted and rounds < cfg.algo.max_refill_rounds:
        rounds += 1
        more = draw(wanted - len(kept_prompts)) if draw is not None else _draw(run, wanted - len(kept_prompts))
        new = _generate_and_score(run, more, params, clock, metrics, group_offset=drawn)
        drawn += len(more)
        more_prompts, more_rollouts = _groups_with_signal(more, new, group)
        kept_prompts += more_prompts
        kept += more_rollouts
    metrics.add({"groups/kept_frac": len(kept_prompts) / drawn, "groups/refill_rounds": float(rounds)})
    return kept_prompts[:wanted], kept[: wanted * group]


def _generate_and_score(
    run: Run, prompts: list[Prompt], params: SamplingParams, clock: "_Clock",
    metrics: Aggregator, *, group_offset: int,
) -> list[Rollout]:
    rollouts = run.generator.generate(prompts, params, group_offset=group_offset)
    clock.mark("generate")
    stats = run.scorer.score({p.id: p for p in prompts}, rollouts)
    # counts and seconds, summed over refill rounds
    metrics.add(stats.metrics())
    if run.cfg.algo.overlong_buffer:
        _apply_overlong_penalty(run, rollouts)
    clock.mark("score")
    return rollouts


def _apply_overlong_penalty(run: Run, rollouts: list[Rollout]) -> None:
    """DAPO's soft overlong punishment added to every scored sample (``reward/overlong``)."""
    a = run.cfg.algo
    lengths = torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float32)
    penalty = overlong_penalty(
        lengths, max_len=run.cfg.rollout.max_new_tokens, buffer=a.overlong_buffer, penalty=a.overlong_penalty
    ).tolist()
    for r, p in zip(rollouts, penalty):
        r.rewards["overlong"] = p
        if r.reward is not None:
            r.reward += p


def _groups_with_signal(
    prompts: list[Prompt], rollouts: list[Rollout], group_size: int
) -> tuple[list[Prompt], list[Rollout]]:
    rewards, valid = rewards_tensor(rollouts)
    keep = groups_with_spread(rewards, group_size, valid=valid).tolist()
    return (
        [p for p, k in zip(prompts, keep) if k],
        [r for i, r in enumerate(rollouts) if keep[i // group_size]],
    )


def learn(run: Run, batch: TrainBatch) -> dict[str, Metric]:
    """``algo.epochs`` passes over ``batch``, each in ``algo.minibatches`` optimizer steps
    on a shuffled split; the critic (PPO) steps on the same mini-batch first, and during
    ``algo.critic_warmup_steps`` it is the only one that steps. Returns the metrics of the
    updates combined, each by its reduction (critic metrics prefixed ``critic/``)."""
    a = run.cfg.algo
    if len(batch) == 0:
        return {"learn/empty_batch": Sum(1.0)}
    updates = Aggregator()
    for _ in range(a.epochs):
        order = (
            torch.randperm(len(batch), generator=run.state.generators["minibatch"])
            if a.minibatches > 1 else torch.arange(len(batch))
        )
        for rows in order.chunk(a.minibatches):
            mb = batch.select(rows) if a.minibatches > 1 else batch
            if run.critic is not None:
                updates.add({f"critic/{k}": v for k, v in run.critic.step(mb).items()})
            if run.step > a.critic_warmup_steps:
                updates.add(run.learner.step(mb))
    return updates.result()


def _eval_metrics(run: Run, bar: ConsoleProgress) -> dict[str, float]:
    if run.rollouts is None:
        return _evaluate(run, bar)
    with run.rollouts.paused():  # the producer's generator, with the learner's newest weights
        run.rollouts.load_latest()
        return _evaluate(run, bar)


def _evaluate(run: Run, bar: ConsoleProgress) -> dict[str, float]:
    cfg = run.cfg
    if run.evaluate_model is not None:
        metrics = run.evaluate_model(run.learner)
    else:
        metrics = evaluate(
            run.generator, run.scorer, run.eval_prompts,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
            temperature=cfg.eval.temperature, batch_size=cfg.eval.batch_size,
            max_prompts=cfg.eval.max_prompts, stop=cfg.rollout.stop,
        )
    skip = {"eval/reward/std", "eval/reward/errors"}
    shown = "  ".join(
        f"{k[len('eval/'):].removeprefix('reward/')} {v:.3f}" for k, v in metrics.items()
        if k.startswith(("eval/reward/", "eval/pref/")) and k not in skip
    )
    errors = f"  (errors {metrics['eval/reward/errors']:.0f})" if metrics.get("eval/reward/errors") else ""
    bar.print(f"eval at step {run.step}: {shown}{errors}")
    return metrics


def _log_eval(run: Run, bar: ConsoleProgress, log: MetricSinks) -> None:
    log.log(run.step, _eval_metrics(run, bar))


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
            "dropped": r.dropped,
            "finish_reason": r.finish_reason,
            "length": len(r.completion_ids),
            "policy_version": r.policy_version,
            **({} if r.turns is None else {
                "turns": r.turns,
                "trained_tokens": int(r.loss_mask.sum()),
                "masked_tokens": int(len(r.loss_mask) - r.loss_mask.sum()),
            }),
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
