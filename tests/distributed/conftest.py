"""One local Ray for every Ray test of the session (starting one costs ~7 s on 2 cores).

No dashboard, Ray token authentication on (its default), 8 logical CPUs so that placements of several actors fit
on a 2-core machine (Ray's CPUs are reservations, not cores)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    ray.init(
        num_cpus=8, include_dashboard=False,
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}, log_to_driver=False,
    )
    yield ray
    ray.shutdown()
