"""The one training loop. Where the pieces run (this process, a Ray cluster) is decided by
whoever builds the :class:`~rltune.runtime.parts.Run` (``runtime/build.py``); the loop only
calls the protocols (``runtime/protocols.py``, ``runtime/sources.py``).

One step::

    batch source: prompts ─► generate ─► score ─► make experience
    loop:         ─► learn ─► batch source: publish weights
"""

from __future__ import annotations

import torch
from rich.markup import escape

from rltune.config import ConfigError
from rltune.data.records import Prompt, Rollout, TrainBatch
from rltune.metrics import keys
from rltune.metrics.sinks import ConsoleProgress, truncate_after_step
from rltune.metrics.types import Aggregator, Last, Metric, Sum
from rltune.runtime.clock import StepClock
from rltune.runtime.parts import Run
from rltune.runtime.reward_errors import RewardErrorLimit, RewardErrorWatch, eval_failures
from rltune.runtime.sinks import MetricSinks, SampleLog, open_sinks
from rltune.runtime.state import restore, save


def train(run: Run, *, stop_after: int | None = None) -> list[dict[str, float]]:
    """Run from the current step (0, or where a checkpoint left off) to ``train.steps``,
    or stop early after step ``stop_after`` with a checkpoint, as a preempted run would.
    Returns the metrics of every step run in this call."""
    cfg = run.cfg
    restored = restore(run)
    resume_after = run.step if restored else None
    notes = [*run.spec.notes, *restored.lines(cfg.train.steps)]
    if resume_after is not None:  # both files readable before either is cut back
        for name in ("samples.jsonl", "metrics.jsonl"):
            truncate_after_step(run.run_dir / name, resume_after, check_only=True)
    samples_log = SampleLog(run.run_dir, resume_after_step=resume_after)
    try:
        metrics_log = open_sinks(cfg, run.run_dir, resume_after_step=resume_after)
    except BaseException:
        samples_log.close()
        raise
    stopped: RewardErrorLimit | None = None
    try:
        ran = _train_steps(run, stop_after, metrics_log, samples_log, notes)
    except RewardErrorLimit as err:  # what the steps before learned is kept, as at the end
        ran, stopped = True, err
    finally:
        run.source.close()
        samples_log.close()
    if ran and not (cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0):
        save(run)
    if stopped is not None:
        raise stopped
    return run.history


def _train_steps(
    run: Run, stop_after: int | None, metrics_log: MetricSinks, samples_log: SampleLog, notes: list[str]
) -> bool:
    """The steps of :func:`train`, with the evaluations before and after; returns whether
    any step ran. ``notes`` are printed first (what was resumed or moved aside)."""
    cfg, progress = run.cfg, run.progress
    with metrics_log, ConsoleProgress(cfg.train.steps, start=progress.step, enabled=cfg.log.console) as bar:
        for note in notes:
            bar.print(escape(note))
        for warning in run.data.warnings:
            bar.print(warning)
        watch = RewardErrorWatch(cfg.train.max_reward_error_steps, bar.print)
        if progress.step == 0 and run.data.eval_prompts:
            _log_eval(run, bar, metrics_log, watch)
        last = cfg.train.steps if stop_after is None else min(stop_after, cfg.train.steps)
        while progress.step < last:
            progress.step += 1
            typed = train_step(run, samples_log, watch=watch)
            if cfg.eval.every and progress.step % cfg.eval.every == 0 and progress.step < cfg.train.steps:
                typed.update(_eval_metrics(run, bar, watch))
            metrics = metrics_log.log(progress.step, typed)
            progress.history.append(metrics)
            bar.update(progress.step, metrics)
            if cfg.checkpoint.every and progress.step % cfg.checkpoint.every == 0:
                save(run)
            watch.check()
        ran = bool(progress.history)  # a run resumed from its final checkpoint has nothing left to do
        if ran and run.data.eval_prompts and progress.step == cfg.train.steps:
            _log_eval(run, bar, metrics_log, watch)
    return ran


def train_step(run: Run, samples_log: SampleLog, *, watch: RewardErrorWatch | None = None) -> dict[str, Metric]:
    """One step: take a batch from the run's source (generated and scored when the
    algorithm is online), learn on it, publish the new weights. Returns the step's
    metrics, typed. ``watch`` is shown the step's rollouts (reward errors on the console),
    and told when the step learned nothing."""
    cfg, step = run.cfg, run.progress.step
    clock = StepClock()
    made = run.source.next(clock)
    batch, rollouts, metrics = made.batch, made.rollouts, made.metrics
    _write_samples(samples_log, step, made.prompts, rollouts, cfg.log.samples_per_step)
    if watch is not None:  # the dropped groups' errors too: a reward failing everywhere keeps no group
        watch.observe(step, [*rollouts, *made.dropped])
    metrics.add(learn(run, batch))
    clock.mark("learn")
    run.source.after_update(clock)
    for part in run.roles.reporting():
        # runtimes whose parts can fail and be replaced report it here (restarts, sync time)
        metrics.add(part.step_metrics())
    times = clock.metrics()
    if made.learner_wait_s is not None:  # the producer's own generate/score times are in metrics
        metrics.add({keys.ASYNC_LEARNER_IDLE_FRAC: made.learner_wait_s / times[keys.TIME_STEP]})
    metrics.add(times)
    step_s = times[keys.TIME_STEP]
    # generated tokens when the step generates, else the tokens learned on
    generated_tokens = sum(len(r.completion_ids) for r in rollouts)
    metrics.add({
        keys.POLICY_VERSION: Last(float(run.learner.version)),
        keys.SAMPLES_PER_S: len(batch) / step_s,
        keys.TOKENS_PER_S: (generated_tokens or float(batch.loss_mask.sum())) / step_s,
    })
    typed = metrics.result()
    if watch is not None and keys.LEARN_EMPTY_BATCH in typed:
        watch.learned_nothing(step, _empty_reason(run, batch, typed))
    return typed


def _empty_reason(run: Run, batch: TrainBatch, metrics: dict[str, Metric]) -> str:
    """Why a step's batch had nothing to learn on, for its warning."""
    if len(batch):
        return "no sample has a completion token"
    if not run.cfg.algo.dynamic_sampling:
        return "no sample was kept"
    failed = sum(m.value for k, m in metrics.items() if k.startswith(keys.reward_errors_key("")))
    errors = f"; {failed:.0f} reward errors" if failed else ""
    return f"no group kept a reward spread (dynamic sampling{errors})"


PAIR = 2
"""Rows of a preference pair: chosen then rejected, next to each other (``collate_pairs``)."""


def learn(run: Run, batch: TrainBatch) -> dict[str, Metric]:
    """``algo.epochs`` passes over ``batch``, each in ``algo.minibatches`` optimizer steps
    on a shuffled split; the critic (PPO) steps on the same mini-batch first, and during
    ``algo.critic_warmup_steps`` it is the only one that steps. A preference method's
    (chosen, rejected) pairs are shuffled and split whole, each in its order. Returns the
    metrics of the updates combined, each by its reduction (critic metrics prefixed ``critic/``)."""
    a = run.cfg.algo
    if len(batch) == 0 or batch.loss_mask.shape[1] == 0:  # no rows, or no completion token in any (all failed)
        return {keys.LEARN_EMPTY_BATCH: Sum(1.0)}
    unit = PAIR if run.spec.algorithm.pairs else 1
    if unit > 1 and a.minibatches > len(batch) // unit:
        raise ConfigError(
            f"algo.minibatches={a.minibatches} is more than the {len(batch) // unit} preference pairs of a "
            f"step: a mini-batch holds whole pairs; set algo.minibatches to at most {len(batch) // unit} "
            f"or raise train.prompts_per_step"
        )
    critic, learner = run.roles.critic, run.roles.learner
    updates = Aggregator()
    for _ in range(a.epochs):
        for rows in minibatch_rows(len(batch), a.minibatches, run.progress.minibatch_rng, unit=unit):
            mb = batch.select(rows) if a.minibatches > 1 else batch
            if critic is not None:
                updates.add({keys.critic_key(k): v for k, v in critic.step(mb).items()})
            if run.progress.step > a.critic_warmup_steps:
                updates.add(learner.step(mb))
    return updates.result()


def minibatch_rows(rows: int, minibatches: int, rng: torch.Generator, *, unit: int = 1) -> list[torch.Tensor]:
    """The row indices of each mini-batch of a batch of ``rows`` rows: its units of ``unit``
    consecutive rows shuffled by ``rng`` and split ``minibatches`` ways (``Tensor.chunk``:
    fewer when the units do not fill them), a unit's rows together and in their order. With
    ``unit=1`` this is ``torch.randperm(rows, generator=rng).chunk(minibatches)``; one
    mini-batch is every row in order, and draws nothing from ``rng``."""
    if minibatches <= 1:
        return [torch.arange(rows)]
    order = torch.randperm(rows // unit, generator=rng)
    return [(units[:, None] * unit + torch.arange(unit)).flatten() for units in order.chunk(minibatches)]


def _eval_metrics(run: Run, bar: ConsoleProgress, watch: RewardErrorWatch) -> dict[str, float]:
    """Evaluate held-out, print the scores (and what failed: the first message of each
    kind of error, and which rewards failed on how many samples); returns the metrics."""
    if run.evaluation is None:
        return {}
    with run.source.evaluating():
        done = run.evaluation()
    metrics = done.metrics
    watch.observe_eval(run.step, done.rollouts)
    shown = "  ".join(f"{keys.held_out_label(k)} {metrics[k]:.3f}" for k in keys.held_out_scores(metrics))
    errors_key = keys.eval_key(keys.REWARD_ERRORS)
    errors = ""
    if metrics.get(errors_key):
        failed = eval_failures(done.failed, done.rollouts)
        errors = f"  (errors {metrics[errors_key]:.0f} of {len(done.rollouts)}{': ' + failed if failed else ''})"
    bar.print(f"eval at step {run.step}: {shown}{escape(errors)}")
    return metrics


def _log_eval(run: Run, bar: ConsoleProgress, log: MetricSinks, watch: RewardErrorWatch) -> None:
    log.log(run.step, _eval_metrics(run, bar, watch))


def _write_samples(
    log: SampleLog, step: int, prompts: list[Prompt], rollouts: list[Rollout], limit: int | None
) -> None:
    by_id = {p.id: p for p in prompts}
    for r in rollouts[:limit] if limit is not None else rollouts:
        prompt = by_id[r.prompt_id]
        log.write({
            "step": step,
            "prompt_id": r.prompt_id,
            "prompt": log.prompt_record(prompt),
            "completion": r.text,
            "reward": r.reward,
            "rewards": r.rewards,
            "reward_error": r.reward_error,
            "dropped": r.dropped,
            "finish_reason": r.finish_reason,
            "length": len(r.completion_ids),
            "policy_version": r.policy_version,
            **({} if not prompt.images else {"images": log.image_refs(prompt.images)}),
            **({} if r.turns is None else {
                "turns": r.turns,
                "trained_tokens": int(r.loss_mask.sum()),
                "masked_tokens": int(len(r.loss_mask) - r.loss_mask.sum()),
            }),
        })
