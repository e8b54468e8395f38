"""How a run's roles are started. ``RayRoles``, with stand-ins for the role classes (no
actors): each role is built without waiting for its actors, ``started`` then waits for
them in the order they were built, and the first that fails stops every one of them;
where two actors may be given one GPU, each role waits before the next starts.
``build_run`` calls ``started`` once every role is built, before any is used."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray")

from rltune.config import ConfigError, load_config  # noqa: E402
from rltune.runtime.build import build_run  # noqa: E402
from rltune.runtime.local import LocalRoles  # noqa: E402
from rltune.runtime.ray import roles as ray_roles  # noqa: E402
from rltune.runtime.ray.roles import RayRoles, shares_devices  # noqa: E402

ROLE_CLASSES = ("RayLearnerGroup", "RayGenerator", "RayScorer", "RayReference", "RayCritic")


class _Part:
    def __init__(self, name: str, log: list[tuple[str, str]], *, fails: bool = False) -> None:
        self.name, self.log, self.fails = name, log, fails

    def started(self) -> None:
        self.log.append(("up", self.name))
        if self.fails:
            raise ConfigError(f"{self.name} refused its input")

    def close(self) -> None:
        self.log.append(("closed", self.name))


def test_the_roles_are_waited_for_in_order_and_the_first_failure_stops_them_all(tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    roles = RayRoles(None, None, tmp_path)
    roles.parts = [_Part("learner", log), _Part("generator", log, fails=True), _Part("scorer", log)]
    with pytest.raises(ConfigError, match="generator refused its input"):
        roles.started()
    assert log == [("up", "learner"), ("up", "generator"),
                   ("closed", "learner"), ("closed", "generator"), ("closed", "scorer")]
    assert roles.parts == []
    roles.started()  # nothing left to wait for


def _build_every_role(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> list[tuple[str, str]]:
    """Ask a ``RayRoles`` for every role (stand-ins record whether they were told to wait),
    then wait for them; returns what happened, in order."""
    log: list[tuple[str, str]] = []
    for name in ROLE_CLASSES:
        def make(*args: object, wait: bool, _name: str = name) -> _Part:
            log.append(("start", f"{_name}, {'waiting' if wait else 'not waiting'}"))
            return _Part(_name, log)
        monkeypatch.setattr(ray_roles, name, make)
    cfg = load_config(None, ["runtime.mode=ray", *overrides])
    roles = RayRoles(None, None, tmp_path)
    roles.learner(cfg, "m", None)
    roles.generator(cfg, "m", None, None, None)
    roles.scorer(cfg, [])
    roles.reference(cfg, "m")
    roles.critic(cfg, "m")
    log.append(("built", "every role"))
    roles.started()
    return log


def test_roles_on_devices_of_their_own_start_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _build_every_role(tmp_path, monkeypatch, "runtime.placement.learner.gpus=1")
    assert log == [*(("start", f"{n}, not waiting") for n in ROLE_CLASSES), ("built", "every role"),
                   *(("up", n) for n in ROLE_CLASSES)]


@pytest.mark.parametrize("sharing", ["runtime.placement.colocate=true", "runtime.placement.generator.gpus=0.5",
                                     "runtime.placement.learner.gpus=1.5"])
def test_roles_that_may_share_a_gpu_start_one_after_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharing: str
) -> None:
    log = _build_every_role(tmp_path, monkeypatch, sharing)
    one_by_one = [event for n in ROLE_CLASSES for event in (("start", f"{n}, not waiting"), ("up", n))]
    assert log == [*one_by_one, ("built", "every role")]


def test_only_colocation_and_fractions_of_a_gpu_share_devices() -> None:
    def shares(*overrides: str) -> bool:
        return shares_devices(load_config(None, ["runtime.mode=ray", *overrides]).runtime.placement)

    assert not shares()
    assert not shares("runtime.placement.learner.gpus=2", "runtime.placement.generator.gpus=1")
    assert shares("runtime.placement.colocate=true")
    assert shares("runtime.placement.scorer.gpus=0.25")


def test_build_run_waits_once_every_role_is_built_and_before_any_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []

    class Recording(LocalRoles):
        def started(self) -> None:
            events.append("started")

    for role in ("learner", "generator", "scorer", "reference", "critic"):
        def built(self: Recording, *args: object, _role: str = role, _make=getattr(LocalRoles, role)) -> object:
            assert "started" not in events, f"{_role} was built after the roles were waited for"
            events.append(_role)
            return _make(self, *args)
        monkeypatch.setattr(Recording, role, built)
    (tmp_path / "r.py").write_text("def r(prompt, completion, **meta):\n    return 0.0\n")
    cfg = load_config(None, [
        "name=p", "model.path=builtin:tiny", "algo.name=ppo", "algo.kl_coef=0.1", "data.train=builtin:arith_small/train",
        f"reward.0.fn={tmp_path / 'r.py'}:r", f"log.dir={tmp_path / 'runs'}", "log.console=false",
    ])
    build_run(cfg, Recording())
    assert events == ["learner", "generator", "scorer", "reference", "critic", "started"]
