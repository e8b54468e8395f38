"""Settings a run does not read in its configuration, refused when set away from their
defaults (a recipe may still spell a default out): the vLLM engine's keys without that
engine, the producer thread's cores without a producer thread, an environment in a run
that plays no episodes, and the cosine schedule's floor on a constant schedule. An
environment's other keys without ``env.name`` are not refused: ``env.name=null`` is how a
recipe's environment is turned off.

Ray's keys (placement, weight sync, restarts, the cluster's address) in a local run are
a note at start instead (:func:`ray_keys_note`): a Ray run's config run locally, to debug
it or compare the two, is common.

The checks run when a run starts or resumes (``rltune.runtime.build``), not when a config
loads: a saved run whose config holds such a key can still be read, compared and exported.
A resume does not count a key its run reads in neither config as a change of meaning
(:func:`unread_prefixes`), so such a run resumes once the key is removed. The algorithm's
own keys (``algo.*``, ``model.critic_path``) are the registry's
(``rltune.algos.registry.unused_key_problems``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rltune.config.runtime import RAY_ONLY, ray_keys_set
from rltune.config.vllm import vllm_keys_set

if TYPE_CHECKING:
    from rltune.config.schema import Config

def unread_prefixes(cfg: Config, *, plays_episodes: bool) -> tuple[str, ...]:
    """The dotted keys (a key, or a section ending in ``.``) this run does not read.
    ``plays_episodes``: the run's generator plays an environment's episodes (an online
    algorithm, or SFT evaluating on ``data.eval``)."""
    unread = []
    if cfg.rollout.engine != "vllm":
        unread.append("rollout.vllm.")
    if cfg.runtime.mode != "ray":
        unread += [f"runtime.{key}." if key == "placement" else f"runtime.{key}" for key in RAY_ONLY]
    if cfg.runtime.mode != "local" or cfg.runtime.max_staleness == 0:
        unread.append("rollout.threads")
    if cfg.env.name is None or not plays_episodes:
        unread.append("env.")
    if cfg.train.schedule == "constant":
        unread.append("train.min_lr_ratio")
    return tuple(unread)


def is_unread(key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether the dotted ``key`` is one of ``prefixes`` or inside one of their sections."""
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


def unused_setting_problems(cfg: Config, *, plays_episodes: bool, algorithm: str, why_no_episodes: str) -> list[str]:
    """One line for each group of keys set away from their defaults that this run would
    not read (module docstring). ``why_no_episodes``: the rest of the line after
    ``algo.name=NAME`` when an environment is named and ``plays_episodes`` is false (why
    this algorithm plays none, and what to set instead)."""
    problems = []
    if cfg.rollout.engine != "vllm" and (keys := vllm_keys_set(cfg.rollout.vllm)):
        problems.append(
            f"{_listed(keys)} {_pick(keys, 'needs', 'need')} rollout.engine=vllm: {_pick(keys, 'it configures', 'they configure')} "
            f"the vLLM engine, and rollout.engine={cfg.rollout.engine} starts none; set rollout.engine: vllm, "
            f"or remove {_pick(keys, 'it', 'them')}"
        )
    r = cfg.runtime
    if cfg.rollout.threads is not None and (r.mode != "local" or r.max_staleness == 0):
        where = ("on Ray the generators use the CPUs they reserve (runtime.placement.generator.cpus): remove it"
                 if r.mode == "ray" else "this run generates in the learner's thread: use train.threads instead, "
                 "and remove rollout.threads")
        problems.append(
            f"rollout.threads={cfg.rollout.threads} is the generator's share of the cores when it runs ahead of the "
            f"learner in one process (runtime.mode: local with runtime.max_staleness > 0); {where}"
        )
    if cfg.env.name is not None and not plays_episodes:
        problems.append(f"env.name does not apply to algo.name={algorithm}{why_no_episodes}")
    if cfg.train.schedule == "constant" and cfg.train.min_lr_ratio != 0.0:
        problems.append(f"train.min_lr_ratio={cfg.train.min_lr_ratio} is where the cosine schedule ends; "
                        "train.schedule is constant: set schedule: cosine, or min_lr_ratio: 0")
    return problems


def ray_keys_note(cfg: Config) -> str | None:
    """A line for Ray's keys set in a local run, or None. A note, not a refusal: running a
    Ray run's config with ``runtime.mode=local`` (to debug it, or to compare the two) is
    common, and the keys there change nothing but what a reader may think."""
    keys = ray_keys_set(cfg.runtime) if cfg.runtime.mode != "ray" else []
    if not keys:
        return None
    return (f"note: {_listed(keys)} {_pick(keys, 'configures', 'configure')} Ray's actors; runtime.mode="
            f"{cfg.runtime.mode} runs every role in this process and reads {_pick(keys, 'it', 'none of them')}")


def ray_threads_note(cfg: Config) -> str | None:
    """A line for ``train.threads`` set in a Ray run, or None. There it sets only the
    driver's torch threads (collation, advantages): each actor runs as many as it reserves
    CPUs. A note, not a refusal, for the reason of :func:`ray_keys_note`."""
    if cfg.runtime.mode != "ray" or cfg.train.threads is None:
        return None
    return (f"note: train.threads={cfg.train.threads} sets the torch threads of this process (the driver) only; on "
            f"Ray each actor runs as many threads as it reserves CPUs (the learners: runtime.placement.learner.cpus="
            f"{cfg.runtime.placement.learner.cpus:g})")


def _listed(keys: list[str]) -> str:
    return " and ".join(keys)


def _pick(keys: list[str], one: str, more: str) -> str:
    return one if len(keys) == 1 else more


__all__ = ["is_unread", "ray_keys_note", "unread_prefixes", "unused_setting_problems"]
