"""Generator and scorer actors, and the driver-side pools that split a step's work
between them and survive their deaths.

A pool holds ``n`` actors of one role, each in its own placement-group bundle. A call
splits its input into ``n`` contiguous shards, one per actor, and joins the results in
shard order, so the output is ordered as one actor's would be. When an actor dies (its
process killed, its node lost) the pool starts a replacement in the same bundle, brings
it to the state the others have (the newest weights for a generator) and reissues the
dead actor's shard to it. A shard's result is taken only from the call that finished, so
every prompt of the step is generated and scored exactly once, whatever died on the way.
After ``runtime.actor_restarts`` replacements of one role the run fails with the cause.

Each replacement is recorded in ``RUN/faults.jsonl`` and counted in the step's
``faults/generator_restarts`` / ``faults/scorer_restarts``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
import torch

from rltune.config.schema import Config
from rltune.data.records import Prompt, Rollout, SamplingParams
from rltune.data.shards import shard_bounds
from rltune.metrics import keys
from rltune.rewards.scorer import ScoreStats
from rltune.runtime.ray.cluster import (
    Placement,
    RayRuntimeError,
    actor_device,
    actor_setup,
    death_reason,
    record_fault,
    refusals,
    refuses_at_start,
)

CALL_TIMEOUT_S = 3600.0
"""A call that neither returns nor fails within this is taken for a hung actor."""

ACTOR_DEATH = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


# ------------------------------------------------------------------------------ the actors


@refuses_at_start
class GeneratorWorker:
    """One generator actor: the policy (from ``model_dir``, LoRA as configured; or a vLLM
    engine of its own with ``rollout.engine: vllm``), the tokenizer, the environment when
    there is one, and its own sampling stream."""

    def __init__(self, cfg: Config, model_dir: str, config_dir: str | None, seed: int, threads: int) -> None:
        from rltune.envs.loading import load_env_factory
        from rltune.models.load import load_tokenizer
        from rltune.runtime.roles import load_policy, make_generator

        actor_setup(threads)
        tokenizer = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
        make_env = None
        if cfg.env.name:
            base = Path(config_dir) if config_dir else None
            make_env = load_env_factory(cfg.env.name, cfg.env.kwargs, base_dir=base)
        self.rng = torch.Generator().manual_seed(seed)
        self.model = load_policy(cfg, model_dir).to(actor_device()).eval() if cfg.rollout.engine == "hf" else None
        self.generator = make_generator(cfg, model_dir, self.model, tokenizer, self.rng, make_env)
        self.sampler = getattr(self.generator, "generator", self.generator)
        """The sampler itself (inside an environment's episode generator, when there is one)."""
        self.channel = None

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts: list[Prompt], params: SamplingParams, group_offset: int) -> list[Rollout]:
        return self.generator.generate(prompts, params, group_offset=group_offset)

    def expert_load(self) -> torch.Tensor | None:
        """The MoE routing counts of this actor's tokens since the last call (None: a
        dense model, or an engine that does not record routes)."""
        take = getattr(self.sampler, "take_expert_load", None)
        return take() if take is not None else None

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> int:
        self.generator.load_weights(version, tensors)
        return version

    def open_channel(self, addr: str, port: int, rank: int, world: int) -> Any:
        """Join a weight channel as receiver ``rank`` (``runtime.weight_sync: broadcast``);
        returns the layout of the weights this generator takes."""
        from rltune.runtime.ray.sync import WeightChannel, layout

        self.close_channel()
        if self.model is None:  # vLLM: the engine's GPU, the learner's (HF) layout
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            mine = layout(self.sampler.meta_weights())
        else:
            device = next(self.model.parameters()).device
            mine = layout(self.model.state_dict())
        self.channel = WeightChannel(addr, port, rank, world, device=device)
        self.layout = mine
        return mine

    def close_channel(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()

    def receive_weights(self) -> int:
        """Receive the weights broadcast on the channel into the model (into the vLLM
        engine bucket by bucket); returns the policy version the sender announced."""
        if self.model is None:
            version, buckets = self.channel.receive_buckets(self.layout)
            self.sampler.load_buckets(buckets)
        else:
            version = self.channel.receive_into(self.model.state_dict())
        self.generator.load_weights(version, None)
        return version

    def weights(self) -> dict[str, torch.Tensor]:
        if self.model is None:
            raise RuntimeError("a vLLM generator's weights are the engine's own; read them there")
        return self.model.state_dict()

    def rng_state(self) -> torch.Tensor:
        return self.rng.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.rng.set_state(state)


@refuses_at_start
class ScorerWorker:
    """One scorer actor: the run's reward functions in a :class:`LocalScorer`."""

    def __init__(self, cfg: Config, config_dir: str | None, threads: int) -> None:
        from rltune.rewards.scorer import LocalScorer, build_reward_fns

        actor_setup(threads)
        r = cfg.runtime
        self.scorer = LocalScorer(
            build_reward_fns(cfg.reward, base_dir=config_dir),
            max_workers=r.reward_workers, pool=r.reward_pool, cache_size=r.reward_cache_size,
        )

    def pid(self) -> int:
        return os.getpid()

    def accuracy_names(self) -> tuple[str, ...]:
        return self.scorer.accuracy_names

    def score(self, prompts: dict[str, Prompt], rollouts: list[Rollout]) -> tuple[list[tuple], ScoreStats]:
        """The reward fields of each rollout (not the rollouts: their tensors need not
        travel back), and the call's statistics."""
        stats = self.scorer.score(prompts, rollouts)
        return [(r.reward, r.rewards, r.reward_error, r.dropped) for r in rollouts], stats

    def close(self) -> None:
        self.scorer.close()


# ------------------------------------------------------------------------------ the pools


def _shards(n: int, parts: int) -> list[tuple[int, int]]:
    """Every actor's contiguous range of ``n`` items (:func:`shard_bounds`; empty ones
    when ``n < parts``)."""
    return [shard_bounds(n, i, parts, allow_empty=True) for i in range(parts)]


class ActorPool:
    """``size`` actors of ``role``; replaces a dead one (up to ``restarts`` times in all)
    and reissues its call. ``prepare(i)`` brings a new actor ``i`` to the pool's state
    before its reissued call (it only submits calls; the actor runs them in order).
    ``wait=False`` starts the actors and leaves the wait for them to :meth:`started`."""

    def __init__(
        self, role: str, cls: type, args: Callable[[int], tuple], placement: Placement, *,
        restarts: int, faults_file: Path | None, prepare: Callable[[int], None] | None = None, wait: bool = True,
    ) -> None:
        self.role, self.placement = role, placement
        self._remote = ray.remote(max_restarts=0, max_task_retries=0)(cls)
        self._args = args
        self.restarts_left = restarts
        self.restarted = 0
        """Replacements since the last :meth:`take_restarts`."""
        self.faults_file = faults_file
        self.prepare = prepare
        self.fresh: set[int] = set()
        """Replacements (and resets) that have not answered a call yet: one that refuses its
        input as it starts may see what its killed predecessor still held (GPU memory, a
        port), so its refusal counts as a death, not as the user's error."""
        self.actors = [self._start(i) for i in range(len(placement.index[role]))]
        if wait:
            self.started()

    def started(self) -> None:
        """Waits until every actor is up, so that start-up errors surface here."""
        try:
            self.call_all("pid")
        except BaseException:
            self.close()  # an actor that refused its input would otherwise hold its bundle
            raise

    @property
    def size(self) -> int:
        return len(self.actors)

    def _start(self, i: int) -> Any:
        return self._remote.options(**self.placement.options(self.role, i)).remote(*self._args(i))

    def call(self, jobs: dict[int, tuple[str, tuple]]) -> dict[int, Any]:
        """Run ``method(*args)`` on actor ``i`` for each ``i: (method, args)``, at once;
        returns each result. A dead actor is replaced and its job reissued."""
        pending = {self.submit(i, *job): i for i, job in jobs.items()}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RayRuntimeError(f"{self.role} actors {sorted(pending.values())} did not answer in {CALL_TIMEOUT_S:.0f} s")
            ref = ready[0]
            i = pending.pop(ref)
            try:
                results[i] = ray.get(ref)
                self.fresh.discard(i)
            except ACTOR_DEATH as err:
                self._replace(i, err)
                pending[self.submit(i, *jobs[i])] = i
            except ray.exceptions.RayTaskError as err:
                if i in self.fresh and isinstance(err, refusals()):
                    self._replace(i, err)
                    pending[self.submit(i, *jobs[i])] = i
                    continue
                # the actor lives but its code raised: the user's error, shown as it is
                raise err.as_instanceof_cause() from None
        return results

    def call_all(self, method: str, *args: Any) -> list[Any]:
        results = self.call({i: (method, args) for i in range(self.size)})
        return [results[i] for i in range(self.size)]

    def submit(self, i: int, method: str, args: tuple) -> ray.ObjectRef:
        return getattr(self.actors[i], method).remote(*args)

    def reset(self, i: int) -> None:
        """Replace live actor ``i`` (it may be stuck waiting on a dead peer); not a fault,
        so it does not count against ``restarts``."""
        ray.kill(self.actors[i], no_restart=True)
        self.actors[i] = self._start(i)
        self.fresh.add(i)
        self._record(i, None)

    def _replace(self, i: int, err: Exception, *, prepare: bool = True) -> None:
        if self.restarts_left <= 0:
            raise RayRuntimeError(
                f"{self.role} actor {i} died and runtime.actor_restarts is used up: {death_reason(err)}"
            ) from None
        self.restarts_left -= 1
        self.restarted += 1
        ray.kill(self.actors[i], no_restart=True)
        self.actors[i] = self._start(i)
        self.fresh.add(i)
        self._record(i, err)
        if prepare and self.prepare is not None:
            self.prepare(i)

    def _record(self, i: int, err: Exception | None) -> None:
        """A line of ``RUN/faults.jsonl``: ``restarted`` (it died: ``err``) or ``reset``."""
        if self.faults_file is not None:
            record_fault(
                self.faults_file, role=self.role, actor=i, event="restarted" if err is not None else "reset",
                error=death_reason(err) if err is not None else None, restarts_left=self.restarts_left,
            )

    def take_restarts(self) -> int:
        n, self.restarted = self.restarted, 0
        return n

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


def _first_deaths(refs: dict[ray.ObjectRef, int]) -> dict[int, Exception]:
    """Wait for ``refs`` (ref -> actor index); as soon as one actor has died, the deaths
    known by then (the others may never finish). An error raised inside a live actor
    (its peer gone mid-broadcast) counts as a failure of that actor too."""
    pending = dict(refs)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=CALL_TIMEOUT_S)
        if not ready:
            raise RayRuntimeError(f"generators {sorted(pending.values())} did not receive the weights in {CALL_TIMEOUT_S:.0f} s")
        i = pending.pop(ready[0])
        try:
            ray.get(ready[0])
        except (*ACTOR_DEATH, ray.exceptions.RayTaskError) as err:
            return {i: err}
    return {}


class RayGenerator:
    """The Generator protocol over a pool of :class:`GeneratorWorker` actors.

    ``load_weights`` puts the weights into Ray's object store once (or takes a reference a
    remote learner already put there) and every actor loads them from it; ``last_sync_s``
    is how long that took. Actor ``i`` samples with seed ``train.seed + i`` (so one actor
    samples as the local runtime does)."""

    def __init__(self, cfg: Config, model_dir: str, config_dir: str | None, placement: Placement,
                 faults_file: Path | None, *, wait: bool = True) -> None:
        seed, threads = cfg.train.seed, placement.threads("generator")
        self.version = 0
        self._weights: Any = None
        self._source: Any = None
        """With broadcast weights: the learner group that sends them."""
        self._channel_open = False
        self._forming = False
        self.last_sync_s = 0.0
        from rltune.parallel.layout import expert_count, model_config_of

        self.records_load = cfg.rollout.engine == "hf" and expert_count(
            model_config_of(model_dir, trust_remote_code=cfg.model.trust_remote_code)) > 0
        """An MoE model on the HF engine: its actors count the experts their tokens chose."""
        self.pool = ActorPool(
            "generator", GeneratorWorker, lambda i: (cfg, model_dir, config_dir, seed + i, threads),
            placement, restarts=cfg.runtime.actor_restarts, faults_file=faults_file, prepare=self._catch_up,
            wait=wait,
        )

    def started(self) -> None:
        self.pool.started()

    def generate(self, prompts: list[Prompt], params: SamplingParams, *, group_offset: int = 0) -> list[Rollout]:
        bounds = _shards(len(prompts), self.pool.size)
        jobs = {
            i: ("generate", (prompts[a:b], params, group_offset + a))
            for i, (a, b) in enumerate(bounds) if b > a
        }
        done = self.pool.call(jobs)
        return [r for i in sorted(done) for r in done[i]]

    def load_weights(self, version: int, tensors: Any = None) -> None:
        """Every actor loads ``tensors`` (a dict, or an object with ``.ref`` to one in the
        object store) as policy ``version``."""
        start = time.perf_counter()
        if tensors is None:
            raise ValueError("RayGenerator.load_weights needs the weights: its actors hold their own copies")
        if hasattr(tensors, "group"):  # BroadcastWeights: received from the learner group
            self._source = tensors.group
            self._broadcast()
        else:
            self._weights = getattr(tensors, "ref", None) or ray.put(tensors)
            self.version = version
            self.pool.call_all("load_weights", version, self._weights)
        self.last_sync_s = time.perf_counter() - start

    def _catch_up(self, i: int) -> None:
        """Bring a replacement actor ``i`` to the others' weights before its next call."""
        if self._source is not None:
            if self._forming:  # its reissued open_channel joins the channel being formed
                return
            self._channel_open = False  # the channel had the dead actor in it
            self._broadcast()
        elif self._weights is not None:
            self.pool.submit(i, "load_weights", (self.version, self._weights))

    # -- weights by broadcast -----------------------------------------------------------

    def _broadcast(self) -> None:
        """Receive the learner group's weights by broadcast (opening the channel first when
        needed). When a generator dies during it, the others may wait for the rest of a
        broadcast that will not come: every generator is replaced (only the dead one
        counts as a fault), the channel formed again and the broadcast repeated."""
        while True:
            if not self._channel_open:
                self._open_channel()
            sends = self._source.start_send()
            receives = {self.pool.submit(i, "receive_weights", ()): i for i in range(self.pool.size)}
            dead = _first_deaths(receives)
            if not dead:
                version, error = self._source.finish_send(sends)
                if error is not None:
                    raise RayRuntimeError(f"the weight broadcast failed: {error}")
                self.version = version  # the learner's at the send; each generator took it from the channel
                return
            for i in range(self.pool.size):
                if i in dead:
                    self.pool._replace(i, dead[i], prepare=False)
                else:
                    self.pool.reset(i)
            self._source.finish_send(sends)  # fails now that its receivers are gone; expected
            self._channel_open = False

    def _open_channel(self) -> None:
        """Learner rank 0 (sender) and every generator (receivers 1..n) form a new channel;
        the layouts of the weights must agree."""
        world = self.pool.size + 1
        addr, port, sender = self._source.open_channel(world)
        self._forming = True
        try:
            joined = self.pool.call({i: ("open_channel", (addr, port, i + 1, world)) for i in range(self.pool.size)})
        finally:
            self._forming = False
        sent = self._source.finish_open(sender)
        for i, mine in joined.items():
            if mine != sent:
                only_sent = sorted(set(map(tuple, sent)) - set(map(tuple, mine)))[:3]
                only_mine = sorted(set(map(tuple, mine)) - set(map(tuple, sent)))[:3]
                raise RayRuntimeError(
                    f"generator {i} holds weights laid out unlike the learner's (learner only: "
                    f"{only_sent}; generator only: {only_mine}); both load model.path"
                )
        self._channel_open = True

    def step_metrics(self) -> dict[str, Any]:
        """Actors replaced since the last call, the last weight load's seconds, and (MoE
        models) the expert load of every actor's generated tokens, summed (``gen/moe/...``)."""
        from rltune.metrics.types import Last, Sum
        from rltune.models.routing import expert_load_metrics

        metrics: dict[str, Any] = {
            keys.restarts_key("generator"): Sum(float(self.pool.take_restarts())),
            keys.TIME_WEIGHT_LOAD: Last(self.last_sync_s),
        }
        if self.records_load:
            loads = [load for load in self.pool.call_all("expert_load") if load is not None]
            if loads:
                metrics.update(expert_load_metrics(sum(loads), key=keys.generation_key))
        return metrics

    def rng_states(self) -> list[torch.Tensor]:
        return self.pool.call_all("rng_state")

    def set_rng_states(self, states: Sequence[torch.Tensor]) -> None:
        self.pool.call({i: ("set_rng_state", (s,)) for i, s in enumerate(states)})

    def close(self) -> None:
        self.pool.close()


class RayScorer:
    """The Scorer protocol over a pool of :class:`ScorerWorker` actors: each scores a
    contiguous share of the rollouts (whole groups when the share allows), the rewards are
    written into the driver's rollouts and the statistics combined
    (:meth:`ScoreStats.combine`)."""

    def __init__(self, cfg: Config, config_dir: str | None, placement: Placement, faults_file: Path | None,
                 *, wait: bool = True) -> None:
        threads = placement.threads("scorer")
        self.pool = ActorPool(
            "scorer", ScorerWorker, lambda i: (cfg, config_dir, threads),
            placement, restarts=cfg.runtime.actor_restarts, faults_file=faults_file, wait=False,
        )
        self.accuracy_names: tuple[str, ...] = ()
        self.names = [rf.name for rf in cfg.reward]
        if wait:
            self.started()

    def started(self) -> None:
        """Waits for the actors; takes the reward functions' accuracy names from the first."""
        self.pool.started()
        self.accuracy_names = self.pool.call({0: ("accuracy_names", ())})[0]

    def score(self, prompts: dict[str, Prompt], rollouts: list[Rollout]) -> ScoreStats:
        bounds = [(a, b) for a, b in _shards(len(rollouts), self.pool.size) if b > a]
        jobs = {}
        for i, (a, b) in enumerate(bounds):
            part = rollouts[a:b]
            mine = {r.prompt_id: prompts[r.prompt_id] for r in part}
            jobs[i] = ("score", (mine, part))
        done = self.pool.call(jobs)
        parts = []
        for i, (a, b) in enumerate(bounds):
            fields, stats = done[i]
            for rollout, (reward, rewards, error, dropped) in zip(rollouts[a:b], fields):
                rollout.reward, rollout.rewards, rollout.reward_error, rollout.dropped = reward, rewards, error, dropped
            parts.append(stats)
        return ScoreStats.combine(parts)

    def step_metrics(self) -> dict[str, Any]:
        from rltune.metrics.types import Sum

        return {keys.restarts_key("scorer"): Sum(float(self.pool.take_restarts()))}

    def close(self) -> None:
        try:
            self.pool.call_all("close")
        except (RayRuntimeError, *ACTOR_DEATH, *refusals()):
            pass
        finally:
            self.pool.close()

