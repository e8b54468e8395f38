"""The local runtime: every role in this process, the generator sharing the learner's
module (a copy of it when rollouts run ahead of the learner), the models on one device
(``runtime.device``: the current CUDA device when torch sees one, else the CPU). Batches,
rollouts and what the roles return stay on the CPU; each model's inputs move to its
device for its forward."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rltune.algos import Algorithm
from rltune.checkpoint.export import export_hf
from rltune.checkpoint.model import frozen_fingerprint
from rltune.config import Config, ConfigError
from rltune.data.records import TrainBatch
from rltune.learner.learner import LocalLearner
from rltune.learner.precision import generator_precision
from rltune.learner.memory import MemorySettingError
from rltune.learner.pair_scoring import learner_pair_outputs, learner_weights_fingerprint
from rltune.learner.parallel import NoParallelism
from rltune.metrics.types import MetricLike
from rltune.models import replay
from rltune.models.lean_forward import supports_lean_forward
from rltune.models.load import resolve_model
from rltune.models.lora import adapters_disabled, is_lora
from rltune.rewards.scorer import LocalScorer, RewardFn
from rltune.runtime.build import build_run as build
from rltune.runtime.loop import train
from rltune.runtime.parts import Run
from rltune.runtime.roles import (
    EnvFactory,
    critic_learner,
    learner_model,
    learner_objective,
    learner_options,
    load_reference_model,
    local_scorer,
    make_generator,
    model_logprobs,
    reference_options,
)
from rltune.runtime.state import apply_learner_state, learner_state, to_cpu

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rltune.envs.episodes import EpisodeGenerator
    from rltune.rollout.hf import HFGenerator


class LocalTrained:
    """A :class:`~rltune.learner.learner.LocalLearner` as a role: the policy learner, or
    PPO's critic (``values``), with the checkpoint hooks of ``runtime/state.py``."""

    def __init__(self, learner: LocalLearner) -> None:
        self.learner = learner

    @property
    def model(self) -> torch.nn.Module:
        return self.learner.model

    @property
    def version(self) -> int:
        return self.learner.version

    writes_shards = False
    """One process writes the one-file checkpoint format."""

    def step(self, batch: TrainBatch) -> dict[str, MetricLike]:
        return self.learner.step(batch)

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.learner.logprobs(batch).cpu()

    def values(self, batch: TrainBatch) -> torch.Tensor:
        return self.learner.values(batch).cpu()

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.learner.export_weights()

    def fetch_weights(self) -> dict[str, torch.Tensor]:
        return self.learner.model.state_dict()

    def pair_outputs(self, batch: TrainBatch, field: str, *, adapters_off: bool = False) -> torch.Tensor:
        return learner_pair_outputs(self.learner, batch, field, adapters_off)

    def weights_fingerprint(self) -> str:
        return learner_weights_fingerprint(self.learner)

    def checkpoint_state(self, prefix: str) -> tuple[dict, dict]:
        return to_cpu(learner_state(self.learner, prefix))

    def load_checkpoint_state(self, tensors: dict, meta: dict, path: Path, prefix: str) -> None:
        apply_learner_state(self.learner, tensors, meta, path, prefix)

    def step_metrics(self) -> dict[str, MetricLike]:
        return {}


@dataclass(frozen=True)
class LocalReference:
    """Log-probs under the frozen starting policy: a second copy of it, or, with LoRA, the
    policy's own module with its adapters switched off (no second copy in memory)."""

    model: torch.nn.Module
    options: dict
    adapters_off: bool = False

    def fingerprint(self) -> str | None:
        if self.adapters_off:  # the policy's base: a LoRA checkpoint fingerprints it itself
            return None
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:  # frozen weights: taken once
        return frozen_fingerprint(self.model)

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if not self.adapters_off:
            return model_logprobs(self.model, batch, self.options)
        training = self.model.training
        batch = dataclasses.replace(batch, routes=None)  # the reference routes by itself
        with adapters_disabled(self.model):
            out = model_logprobs(self.model.eval(), batch, self.options)
        self.model.train(training)
        return out


@dataclass
class LocalStreams:
    """The run's RNG streams, all in this process."""

    generators: dict[str, torch.Generator] = field(default_factory=dict)

    def restored(self) -> None:
        pass


def local_device(cfg: Config) -> torch.device:
    """The device ``runtime.device`` names on this machine: ``auto``: the current CUDA
    device when torch sees one, else the CPU. Refuses ``cuda`` without a CUDA device, and
    ``train.offload: optimizer`` on the CPU (the state is in host memory already), before
    any model loads."""
    setting = cfg.runtime.device
    cuda = torch.cuda.is_available()
    if setting == "cuda" and not cuda:
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(f"runtime.device=cuda, but torch {torch.__version__} ({built}) sees no CUDA device; "
                          "set runtime.device: cpu (or auto)")
    device = torch.device("cuda", torch.cuda.current_device()) if setting != "cpu" and cuda else torch.device("cpu")
    if cfg.train.offload == "optimizer" and device.type == "cpu":
        raise MemorySettingError(
            "train.offload: optimizer moves AdamW's state from a GPU learner to host memory, but this local run "
            "trains on the CPU (torch sees no CUDA device), where it is in host memory already; set "
            "train.offload: none")
    return device


def reuse_applies(cfg: Config, model: torch.nn.Module) -> bool:
    """Whether the learner's forward can take the products of a decode on ``model``
    (``train.reuse_rollout_mb``, :mod:`rltune.models.replay`): float32 weights, learner
    and sampler in float32, no activation checkpointing or ``train.compile``, a model the
    lean forward runs. Elsewhere the decoder keeps nothing (what it kept would never be read)."""
    t = cfg.train
    weights = next(model.parameters(), None)
    return (t.reuse_rollout_mb > 0 and t.precision == "fp32" and generator_precision(cfg) == "fp32"
            and weights is not None and weights.dtype == torch.float32
            and t.activation_checkpointing == "none" and not t.compile and supports_lean_forward(model))


class LocalRoles:
    """Every role in this process (:class:`rltune.runtime.roles.Roles`), its models on
    ``device`` (None: where they load). The generator runs on the learner's module
    (``rollout.engine: hf``), or on a copy of it when rollouts run ahead of the learner;
    with LoRA the reference is that module with adapters off."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.policy: torch.nn.Module | None = None

    def learner(self, cfg: Config, model_dir: str, algorithm: Algorithm) -> LocalTrained:
        model = learner_model(cfg, model_dir)
        self.policy = model
        return LocalTrained(LocalLearner(model, learner_objective(cfg, algorithm), cfg.train,
                                         parallelism=NoParallelism(self.device), **learner_options(cfg, algorithm, model)))

    def shares_weights(self, cfg: Config) -> bool:
        return cfg.rollout.engine == "hf" and cfg.runtime.max_staleness == 0  # vLLM holds its own copy

    def generator(self, cfg: Config, model_dir: str, tokenizer: "PreTrainedTokenizerBase",
                  rng: torch.Generator, make_env: EnvFactory | None) -> "EpisodeGenerator | HFGenerator":
        model = self.policy
        if cfg.rollout.engine == "hf" and not self.shares_weights(cfg):
            # the producer generates on its own copy while the learner updates the original
            model = copy.deepcopy(model).eval()
        elif model is not None and self.shares_weights(cfg) and reuse_applies(cfg, model):
            replay.keep_records(model, cfg.train.reuse_rollout_mb << 20)  # the learner's forward reuses the decode's
        return make_generator(cfg, model_dir, model, tokenizer, rng, make_env)

    def scorer(self, cfg: Config, reward_fns: list[RewardFn]) -> LocalScorer:
        return local_scorer(cfg, reward_fns)

    def reference(self, cfg: Config, model_dir: str) -> LocalReference:
        if self.policy is not None and is_lora(self.policy):
            return LocalReference(self.policy, reference_options(cfg), adapters_off=True)
        return LocalReference(load_reference_model(cfg, model_dir, self.device), reference_options(cfg))

    def critic(self, cfg: Config, model_dir: str) -> LocalTrained:
        return LocalTrained(critic_learner(cfg, model_dir, self.device))

    def streams(self, generators: dict[str, torch.Generator]) -> LocalStreams:
        return LocalStreams(generators)

    def started(self) -> None:
        """Nothing to wait for: each role was built in this process as it was asked for."""


def build_run(cfg: Config, *, config_dir: Path | None = None) -> Run:
    """Load model, data and rewards for ``cfg`` and wire them into a :class:`Run` whose
    roles all live in this process."""
    return build(cfg, LocalRoles(local_device(cfg)), config_dir=config_dir)


def run_local(cfg: Config, *, config_dir: Path | None = None) -> Run:
    """Train ``cfg`` in this process and export the final model."""
    roles = LocalRoles(local_device(cfg))
    run = build(cfg, roles, config_dir=config_dir)
    try:
        train(run)
    finally:
        if run.scorer is not None:
            run.scorer.close()
    if cfg.checkpoint.final:
        export_hf(roles.policy, run.tokenizer, run.run_dir / "final",
                  processor_from=Path(resolve_model(cfg.model.path)))
    return run


__all__ = ["LocalReference", "LocalRoles", "LocalStreams", "LocalTrained", "build_run", "local_device", "run_local"]
