"""How ``RayRoles`` starts a run's roles, with stand-ins for the roles (no actors): each
role is asked for without waiting, ``started`` then waits for them in the order they were
built, and the first that fails stops every one of them; a generator that shares a
learner's bundle is started only once the learners are up."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray")

from rltune.config import ConfigError, load_config  # noqa: E402
from rltune.runtime.ray import roles as ray_roles  # noqa: E402
from rltune.runtime.ray.roles import RayRoles  # noqa: E402


class _Part:
    def __init__(self, name: str, log: list[tuple[str, str]], *, fails: bool = False) -> None:
        self.name, self.log, self.fails = name, log, fails

    def started(self) -> None:
        self.log.append(("started", self.name))
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
    assert log == [("started", "learner"), ("started", "generator"),
                   ("closed", "learner"), ("closed", "generator"), ("closed", "scorer")]
    assert roles.parts == []
    roles.started()  # nothing left to wait for


@pytest.mark.parametrize("colocate", [False, True])
def test_a_generator_on_a_learners_bundle_starts_once_the_learners_are_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, colocate: bool
) -> None:
    log: list[tuple[str, str]] = []

    def generator(*args: object, wait: bool) -> _Part:
        log.append(("generator starts", "waiting" if wait else "not waiting"))
        return _Part("generator", log)

    monkeypatch.setattr(ray_roles, "RayGenerator", generator)
    roles = RayRoles(None, None, tmp_path)
    roles.parts = [_Part("learner", log)]
    cfg = load_config(None, ["runtime.mode=ray", f"runtime.placement.colocate={str(colocate).lower()}"])
    roles.generator(cfg, "unused", None, None, None)
    first = [("started", "learner")] if colocate else []
    assert log == [*first, ("generator starts", "not waiting")]
