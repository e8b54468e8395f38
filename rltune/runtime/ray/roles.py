"""The run's roles as Ray actors (:class:`RayRoles`, the ``Roles`` of
``rltune/runtime/roles.py``): the learner group, generator and scorer pools, and, when the
algorithm needs them, the reference model (one actor computing the KL term's log-probs)
and PPO's critic (one actor training the value model). Each actor gets a bundle of the
run's placement group; the reference and the critic reserve what a learner reserves
(``runtime.placement.learner``): they hold a model of the policy's size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.exceptions import RayActorError

from rltune.algos import Algorithm
from rltune.checkpoint.model import frozen_fingerprint
from rltune.config import Config
from rltune.data.records import TrainBatch
from rltune.metrics.types import MetricLike
from rltune.rewards.scorer import RewardFn
from rltune.runtime.ray.cluster import (
    Placement,
    RayRuntimeError,
    actor_device,
    actor_setup,
    death_reason,
    refuses_at_start,
)
from rltune.runtime.ray.learner import LearnerDied, RayLearnerGroup
from rltune.runtime.ray.rollouts import ActorPool, RayGenerator, RayScorer
from rltune.runtime.roles import (
    EnvFactory,
    critic_learner,
    load_reference_model,
    lookup_algorithm,
    model_logprobs,
    reference_options,
    seed_everything,
)
from rltune.runtime.state import apply_learner_state, learner_state, to_cpu

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rltune.config.runtime import PlacementConfig


def model_roles(cfg: Config) -> tuple[str, ...]:
    """The placement roles besides learner, generator and scorer that ``cfg`` needs:
    ``reference`` (an online run with a KL term) and ``critic`` (PPO)."""
    algorithm = lookup_algorithm(cfg.algo.name)
    roles = []
    if algorithm.online and algorithm.requires_reference(cfg.algo.kl_coef):
        roles.append("reference")
    if algorithm.needs_critic:
        roles.append("critic")
    return tuple(roles)


# ------------------------------------------------------------------------------ the actors


@refuses_at_start
class ReferenceWorker:
    """The frozen starting policy (a copy of ``model_dir``) computing log-probs."""

    def __init__(self, cfg: Config, model_dir: str, threads: int) -> None:
        actor_setup(threads)
        seed_everything(cfg.train.seed)
        self.model = load_reference_model(cfg, model_dir, actor_device())
        self.options = reference_options(cfg)
        self._fingerprint: str | None = None

    def pid(self) -> int:
        return os.getpid()

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return model_logprobs(self.model, batch, self.options)

    def checked_logprobs(self, batch: TrainBatch) -> tuple[torch.Tensor, str]:
        """The log-probs and the fingerprint of the weights that computed them."""
        return self.logprobs(batch), self.fingerprint()

    def fingerprint(self) -> str:
        if self._fingerprint is None:  # frozen weights: taken once, not at every save
            self._fingerprint = frozen_fingerprint(self.model)
        return self._fingerprint


@refuses_at_start
class CriticWorker:
    """PPO's critic: the value model and its optimizer, built as the local runtime does."""

    def __init__(self, cfg: Config, model_dir: str, threads: int) -> None:
        actor_setup(threads)
        seed_everything(cfg.train.seed)
        self.learner = critic_learner(cfg, model_dir, actor_device())

    def pid(self) -> int:
        return os.getpid()

    def step(self, batch: TrainBatch) -> dict[str, MetricLike]:
        return self.learner.step(batch)

    def values(self, batch: TrainBatch) -> torch.Tensor:
        return self.learner.values(batch).cpu()

    def checkpoint_state(self, prefix: str) -> tuple[dict, dict]:
        return to_cpu(learner_state(self.learner, prefix))

    def load_checkpoint_state(self, tensors: dict, meta: dict, path: str, prefix: str) -> None:
        apply_learner_state(self.learner, tensors, meta, Path(path), prefix)


# ------------------------------------------------------------------------------ the handles


class RayReference:
    """The Reference protocol over one :class:`ReferenceWorker` (replaced if it dies: it
    holds no state but the frozen weights). A replacement loads ``model.path`` again; its
    weights are checked against those the run started with before its log-probs are used."""

    def __init__(self, cfg: Config, model_dir: str, placement: Placement, faults_file: Path | None,
                 *, wait: bool = True) -> None:
        _require(placement, "reference")
        threads = placement.threads("reference")
        self.pool = ActorPool("reference", ReferenceWorker, lambda i: (cfg, model_dir, threads), placement,
                              restarts=cfg.runtime.actor_restarts, faults_file=faults_file, wait=False)
        self.model_dir = model_dir
        self._fingerprint = ""
        if wait:
            self.started()

    def started(self) -> None:
        """Waits for the actor; takes the fingerprint of the weights it loaded."""
        try:
            self.pool.started()
            self._fingerprint = self.pool.call({0: ("fingerprint", ())})[0]
        except BaseException:
            self.pool.close()
            raise

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        out, weights = self.pool.call({0: ("checked_logprobs", (batch,))})[0]
        if weights != self._fingerprint:  # a replacement loaded model.path again, and it changed
            raise RayRuntimeError(
                f"the reference actor was replaced (it died) and loaded other weights from {self.model_dir} than the "
                "run started with (their fingerprint differs): the files there changed during the run, and the KL "
                "term would measure against another model from here on; put the weights the run started from back "
                "at model.path and resume from the newest checkpoint"
            )
        return out

    def fingerprint(self) -> str:
        """Of the weights the actor loaded from ``model.path`` at the start (its own copy,
        LoRA or not)."""
        return self._fingerprint

    def close(self) -> None:
        self.pool.close()


class RayCritic:
    """The Critic protocol over one :class:`CriticWorker`. Its optimizer state dies with
    it, so a dead critic is a :class:`LearnerDied`: the run resumes from its checkpoint."""

    def __init__(self, cfg: Config, model_dir: str, placement: Placement, *, wait: bool = True) -> None:
        _require(placement, "critic")
        remote = ray.remote(max_restarts=0, max_task_retries=0)(CriticWorker)
        self.actor = remote.options(**placement.options("critic", 0)).remote(cfg, model_dir, placement.threads("critic"))
        if wait:
            self.started()

    def started(self) -> None:
        """Waits until the actor has built its model and optimizer."""
        self._get(self.actor.pid.remote(), "start")

    def step(self, batch: TrainBatch) -> dict[str, MetricLike]:
        return self._get(self.actor.step.remote(batch), "step")

    def values(self, batch: TrainBatch) -> torch.Tensor:
        return self._get(self.actor.values.remote(batch), "values")

    def checkpoint_state(self, prefix: str) -> tuple[dict, dict]:
        return self._get(self.actor.checkpoint_state.remote(prefix), "checkpoint_state")

    def load_checkpoint_state(self, tensors: dict, meta: dict, path: Path, prefix: str) -> None:
        mine = {k: v for k, v in tensors.items() if k.startswith(prefix)}
        self._get(self.actor.load_checkpoint_state.remote(mine, meta, str(path), prefix), "load_checkpoint_state")

    def _get(self, ref: ray.ObjectRef, what: str) -> Any:
        try:
            return ray.get(ref)
        except RayActorError as err:
            raise LearnerDied(f"the critic actor died during {what}: {death_reason(err)}") from err

    def close(self) -> None:
        ray.kill(self.actor, no_restart=True)


def _require(placement: Placement, role: str) -> None:
    if not placement.index.get(role):
        raise RayRuntimeError(
            f"the run needs a {role} actor and the placement has no bundle for one; place it with "
            f"rltune.runtime.ray.run.place_run(cfg) (or place(..., extra=model_roles(cfg)))"
        )


# ------------------------------------------------------------------------------ the roles


class RayRunState:
    """The RNG streams a checkpoint carries: the driver's own (``generators``) and each
    generator actor's sampling stream, mirrored here as ``sampling/I`` when a checkpoint
    is written and handed back to the actors when one is restored."""

    def __init__(self, generators: dict[str, torch.Generator], roles: "RayRoles") -> None:
        self._own = generators
        self._roles = roles
        self._mirrors: dict[str, torch.Generator] = {}

    @property
    def generators(self) -> dict[str, torch.Generator]:
        gen = self._roles.current_generator
        if gen is not None:
            for i, state in enumerate(gen.rng_states()):
                self._mirrors.setdefault(f"sampling/{i}", torch.Generator()).set_state(state)
        return {**self._own, **self._mirrors}

    def restored(self) -> None:
        gen = self._roles.current_generator
        if gen is not None:
            gen.set_rng_states([self._mirrors[f"sampling/{i}"].get_state() for i in range(gen.pool.size)])


class RayRoles:
    """Starts the run's actors in ``placement`` (see ``rltune.runtime.roles.Roles``). When no
    two actors can share a GPU, every role's actors start at once and :meth:`started` waits
    for them all, so the run starts in the time of its slowest role, not in the sum of them.
    When some can (``runtime.placement.colocate``, or a fraction of a GPU), each role starts
    once the one before it has loaded, so that an engine sizing its cache by the device's
    free memory sees what the others took."""

    def __init__(self, placement: Placement, config_dir: Path | None, run_dir: Path) -> None:
        self.placement = placement
        self.config_dir = str(config_dir) if config_dir else None
        self.faults_file = run_dir / "faults.jsonl"
        self.current_generator: RayGenerator | None = None
        self.parts: list[Any] = []
        self._up = 0
        """How many of ``parts`` (from the first) have been waited for."""

    def learner(self, cfg: Config, model_dir: str, algorithm: Algorithm) -> RayLearnerGroup:
        return self._keep(cfg, RayLearnerGroup(cfg, model_dir, self.placement, wait=False))

    def shares_weights(self, cfg: Config) -> bool:
        return False  # every generator actor holds its own copy

    def generator(self, cfg: Config, model_dir: str, tokenizer: "PreTrainedTokenizerBase",
                  rng: torch.Generator, make_env: EnvFactory | None) -> RayGenerator:
        # each actor loads its own tokenizer and environment and samples with its own stream
        self.current_generator = self._keep(
            cfg, RayGenerator(cfg, model_dir, self.config_dir, self.placement, self.faults_file, wait=False))
        return self.current_generator

    def scorer(self, cfg: Config, reward_fns: list[RewardFn]) -> RayScorer:
        return self._keep(cfg, RayScorer(cfg, self.config_dir, self.placement, self.faults_file, wait=False))

    def reference(self, cfg: Config, model_dir: str) -> RayReference:
        return self._keep(cfg, RayReference(cfg, model_dir, self.placement, self.faults_file, wait=False))

    def critic(self, cfg: Config, model_dir: str) -> RayCritic:
        return self._keep(cfg, RayCritic(cfg, model_dir, self.placement, wait=False))

    def streams(self, generators: dict[str, torch.Generator]) -> RayRunState:
        # the driver does not sample: each generator actor has its own stream
        return RayRunState({k: v for k, v in generators.items() if k != "sampling"}, self)

    def started(self) -> None:
        """Waits until the actors of every role are up, in the order the roles were built;
        at the first of them that fails, stops all of them and raises."""
        try:
            while self._up < len(self.parts):
                self.parts[self._up].started()
                self._up += 1
        except BaseException:
            self.close()
            raise

    def _keep(self, cfg: Config, part: Any) -> Any:
        self.parts.append(part)
        if shares_devices(cfg.runtime.placement):
            self.started()  # the next role starts once this one holds its memory
        return part

    def close(self) -> None:
        """Stop every actor this object started (idempotent)."""
        parts, self.parts, self.current_generator, self._up = self.parts, [], None, 0
        for part in parts:
            try:
                part.close()
            except Exception:  # noqa: BLE001 - an actor already gone needs no stopping
                pass


def shares_devices(placement: PlacementConfig) -> bool:
    """Whether two of the run's actors may be given the same GPU: colocated bundles, or a
    role that reserves a fraction of one (Ray packs fractions onto one device)."""
    shares = (placement.learner.gpus, placement.generator.gpus, placement.scorer.gpus)
    return placement.colocate or any(gpus != int(gpus) for gpus in shares)
