"""An actor whose construction refuses its input (``rltune/runtime/ray/cluster.py``
``refuses_at_start``) hands the driver the user's error at once: it is not taken for a
dead actor and restarted (``runtime.learner_restarts``, ``runtime.actor_restarts``) to
the same refusal.

The learner case is a whole ``run_ray`` on a model whose weights file is damaged after
the driver's checks (the driver reads the config and tokenizer, never the weights): the
learner ranks refuse it as they load it, and the run ends with the ``ModelLoadError``
naming the file, with no resume recorded."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from rltune.config import ConfigError, load_config  # noqa: E402
from rltune.models.load import ModelLoadError  # noqa: E402
from rltune.runtime.ray.cluster import RayRuntimeError, place, refuses_at_start  # noqa: E402
from rltune.runtime.ray.learner import LearnerDied  # noqa: E402
from rltune.runtime.ray.rollouts import ActorPool  # noqa: E402
from rltune.runtime.ray.run import run_ray  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@refuses_at_start
class Refusing:
    """An actor whose construction refuses its config, after a first attempt to work."""

    def __init__(self, why: str) -> None:
        self.started = True
        raise ConfigError(why)

    def pid(self) -> int:
        return 1

    def work(self) -> str:
        return "worked"


@refuses_at_start
class RefusingOnceMarked:
    """Starts, unless ``marker`` exists (what a killed predecessor still holds)."""

    def __init__(self, marker: str) -> None:
        if Path(marker).exists():
            raise ConfigError(f"{marker} is held")

    def pid(self) -> int:
        return 1


@refuses_at_start
class Working:
    def __init__(self, answer: str) -> None:
        self.answer = answer

    def pid(self) -> int:
        return 1

    def work(self) -> str:
        return self.answer


def test_a_refusing_pool_actor_raises_the_users_error_and_is_not_restarted(ray_cluster, tmp_path: Path) -> None:
    cfg = load_config(None, ["runtime.mode=ray", "runtime.placement.learners=1"])
    placement = place(cfg.runtime.placement, name="test-refusal")
    faults = tmp_path / "faults.jsonl"
    try:
        with pytest.raises(ConfigError, match="rollout.compile=true needs g\\+\\+") as caught:
            ActorPool("generator", Refusing, lambda i: ("rollout.compile=true needs g++",), placement,
                      restarts=3, faults_file=faults)
        assert not isinstance(caught.value, ray.exceptions.RayActorError)
        assert not faults.exists()  # no actor was counted dead, none replaced
        pool = ActorPool("generator", Working, lambda i: ("ok",), placement, restarts=3, faults_file=faults)
        try:  # the wrapping leaves a working actor's calls as they were
            assert pool.call_all("work") == ["ok"]
        finally:
            pool.close()
    finally:
        placement.remove()


def test_a_learner_rank_that_refuses_its_model_ends_the_run_with_that_error(
    ray_cluster, model_dir: str, tmp_path: Path
) -> None:
    damaged = tmp_path / "model"
    shutil.copytree(model_dir, damaged)
    (damaged / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    cfg = load_config(None, [
        "name=refused", f"model.path={damaged}", "algo.name=grpo", "reward.0.fn=builtin:exact_numeric",
        "data.train=builtin:arith_small/train", "train.steps=2", f"log.dir={tmp_path / 'runs'}", "log.console=false",
        "runtime.mode=ray", "runtime.placement.learners=2", "runtime.learner_restarts=2",
    ])
    with pytest.raises(ModelLoadError, match="model.safetensors") as caught:
        run_ray(cfg)
    assert not isinstance(caught.value, LearnerDied)
    assert not (tmp_path / "runs" / "refused" / "faults.jsonl").exists()  # no resume was tried


def test_a_replacement_that_refuses_counts_as_a_death(ray_cluster, tmp_path: Path) -> None:
    """A replacement may see what the actor it replaces held: its refusal uses a restart,
    and once they are used up the run ends naming the refusal."""
    cfg = load_config(None, ["runtime.mode=ray", "runtime.placement.learners=1"])
    placement = place(cfg.runtime.placement, name="test-refusal-replaced")
    marker, faults = tmp_path / "held", tmp_path / "faults.jsonl"
    try:
        pool = ActorPool("generator", RefusingOnceMarked, lambda i: (str(marker),), placement,
                         restarts=2, faults_file=faults)
        try:
            marker.touch()
            victim = pool.actors[0]
            ray.kill(victim, no_restart=True)
            _wait_until_gone(victim)  # a kill is asynchronous: the victim may still answer a call made at once
            with pytest.raises(RayRuntimeError, match="actor_restarts is used up: .*ConfigError: .*held"):
                pool.call_all("pid")
            assert len(faults.read_text().splitlines()) == 2  # the death, then the first replacement's refusal
        finally:
            pool.close()
    finally:
        placement.remove()


def test_the_wrapper_keeps_a_refusal_without_its_traceback_and_lets_other_errors_through() -> None:
    """In one process, without Ray: every call raises the kept refusal, its traceback as
    short each time (not one raise's frames added to the last's); an error that is not a
    refusal (a transient one) still fails the construction, so Ray restarts the actor."""
    import traceback

    refusing = Refusing("no compiler")
    lengths = []
    for method in (refusing.pid, refusing.work, refusing.pid):
        with pytest.raises(ConfigError, match="no compiler") as caught:
            method()
        lengths.append(len(traceback.format_exception(caught.value)))
    assert lengths[0] == lengths[1] == lengths[2]

    @refuses_at_start
    class Transient:
        def __init__(self) -> None:
            raise RuntimeError("rendezvous timed out")

    with pytest.raises(RuntimeError, match="rendezvous"):
        Transient()
    assert Working("ok").work() == "ok"


def _wait_until_gone(actor, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.pid.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    pytest.fail(f"a killed actor still answered after {timeout_s:.0f} s")
