"""One local Ray for the Ray tests (starting one costs ~7 s on 2 cores), stopped after the
last test that uses it, so that its idle processes do not share the cores with the rest
of the suite.

No dashboard, Ray token authentication on (its default), 8 logical CPUs so that placements
of several actors fit on a 2-core machine (Ray's CPUs are reservations, not cores)."""

from __future__ import annotations

import sys

import pytest

_LAST_RAY_TEST: list[str] = []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``builtin:tiny`` (tied embeddings) built once per module; every process of a group
    loads it from this directory. A module on another model defines its own."""
    from rltune.models.load import resolve_model

    return resolve_model("builtin:tiny", cache_dir=str(tmp_path_factory.mktemp("builtin")))


@pytest.fixture(scope="module")
def single(model_dir: str) -> dict:
    """One process's two steps on ``model_dir`` (``layout_workers.reference``), what a
    layout's group is compared with. A module with another reference defines its own."""
    from layout_workers import reference

    return reference(model_dir)


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    ray.init(
        num_cpus=8, include_dashboard=False,
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}, log_to_driver=False,
    )
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    users = [item.nodeid for item in items if "ray_cluster" in getattr(item, "fixturenames", ())]
    _LAST_RAY_TEST[:] = users[-1:]


@pytest.hookimpl(trylast=True)  # after the item's module fixtures have stopped their actors
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    ray = sys.modules.get("ray")
    if _LAST_RAY_TEST and item.nodeid == _LAST_RAY_TEST[0] and ray is not None and ray.is_initialized():
        ray.shutdown()
