"""What the search takes is bounded before it starts: ``--gpus`` (or a cluster file's
``gpus``) past ``MAX_GPUS`` and a staleness past ``MAX_STALENESS`` (the flag or the
config's ``runtime.max_staleness``) are one-line refusals naming the flag or key, not a
search that runs for hours; ``--seed`` outside what TPE's sampler takes is refused the
same way; the space is counted without listing every staleness."""

from __future__ import annotations

import argparse
import time

import pytest

from rltune.plan.cluster import load_cluster
from rltune.plan.command import add_arguments, flag_problems
from rltune.plan.errors import PlanError
from rltune.plan.bounds import MAX_GPUS, MAX_STALENESS
from rltune.plan.search import SearchSpace, default_space, divisors, enumerate_candidates, space_size
from rltune.plan.spec import Cluster

from plan_fixtures import SMALL, grpo


def _problems(*argv: str) -> list[str]:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return flag_problems(p.parse_args(["c.yaml", *argv]))


def test_the_bounds_in_range_pass():
    assert _problems("--gpus", str(MAX_GPUS), "--max-staleness", str(MAX_STALENESS), "--seed", str(2**32 - 1)) == []


def test_too_many_gpus_is_refused():
    (line,) = _problems("--gpus", "100000000")
    assert line == (f"--gpus 100000000: the planner searches clusters of at most {MAX_GPUS:,} devices (its time "
                    f"grows with the count); plan for {MAX_GPUS} or fewer")
    assert _problems("--gpus", str(MAX_GPUS + 1))


def test_too_much_staleness_is_refused():
    (line,) = _problems("--gpus", "8", "--max-staleness", "1000000000")
    assert line.startswith(f"--max-staleness 1000000000: the planner searches staleness up to {MAX_STALENESS} ")
    assert line.endswith(f"give --max-staleness {MAX_STALENESS} or less")


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_seed_tpe_cannot_take_is_refused(seed):
    assert _problems("--gpus", "64", "--budget", "1", "--seed", seed) == [
        f"--seed {seed}: must be 0 .. 2**32-1 (4294967295), the seeds TPE's sampler takes"]


def test_a_cluster_file_past_the_bound_is_refused(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("gpus: 100000\n")
    with pytest.raises(PlanError, match=rf"^`gpus` in {path} 100000: the planner searches clusters of at most "):
        load_cluster(path)


def test_the_configs_staleness_past_the_bound_is_refused():
    with pytest.raises(PlanError, match=r"^runtime\.max_staleness 1000: .* give --max-staleness 64 or less$"):
        default_space(SMALL, grpo(max_staleness=1000), Cluster(gpus=8))
    with pytest.raises(PlanError, match=r"^--max-staleness 65: "):
        default_space(SMALL, grpo(), Cluster(gpus=8), max_staleness=MAX_STALENESS + 1)
    assert default_space(SMALL, grpo(max_staleness=1000), Cluster(gpus=8), max_staleness=2).max_staleness == 2


def test_the_space_is_counted_not_listed():
    cluster = Cluster(gpus=8, gpus_per_node=4)
    space = SearchSpace(micro_batch_tokens=(4096, 8192), max_staleness=3)
    assert space_size(SMALL, grpo(), cluster, space) == sum(1 for _ in enumerate_candidates(SMALL, grpo(), cluster, space))
    start = time.perf_counter()
    big = space_size(SMALL, grpo(), Cluster(gpus=MAX_GPUS), SearchSpace(max_staleness=MAX_STALENESS))
    assert big > 10**6 and time.perf_counter() - start < 20  # the whole bound counts in seconds
    with pytest.raises(PlanError, match="the planner searches staleness up to"):
        space_size(SMALL, grpo(), cluster, SearchSpace(max_staleness=10**9))


def test_divisors():
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 500))
    assert divisors(2**40) == [2**k for k in range(41)]
