"""A KL reference actor that dies is replaced and loads ``model.path`` again
(``rltune/runtime/ray/roles.py`` ``RayReference``): with the same weights there the run
goes on with the same log-probs; with other weights there (the files changed during the
run) the replacement is refused before its log-probs are used, since the KL term would
silently measure against another model from then on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from learner_group_workers import make_batch  # noqa: E402

from rltune.config import load_config  # noqa: E402
from rltune.models.load import load_model  # noqa: E402
from rltune.runtime.ray.cluster import RayRuntimeError, place  # noqa: E402
from rltune.runtime.ray.roles import RayReference  # noqa: E402


@pytest.mark.slow  # ~30 s with its own Ray: a rare path, kept out of the default run
def test_a_replaced_reference_is_checked_against_the_weights_the_run_started_with(
    ray_cluster, model_dir: str, tmp_path: Path
) -> None:
    weights = tmp_path / "model"
    shutil.copytree(model_dir, weights)
    cfg = load_config(None, [f"model.path={weights}", "algo.name=grpo", "algo.kl_coef=0.1",
                             "reward.0.fn=builtin:exact_numeric", "runtime.mode=ray", "runtime.placement.learners=1"])
    batch = make_batch(load_model(model_dir))
    placement = place(cfg.runtime.placement, name="test-reference-replaced", extra=("reference",))
    try:
        reference = RayReference(cfg, str(weights), placement, tmp_path / "faults.jsonl")
        try:
            first, started = reference.logprobs(batch), reference.fingerprint()
            ray.kill(reference.pool.actors[0], no_restart=True)  # same weights at model.path
            assert torch.equal(reference.logprobs(batch), first)
            assert reference.pool.restarted == 1 and reference.fingerprint() == started
            other = load_model(model_dir)
            with torch.no_grad():
                for p in other.parameters():
                    p.add_(0.01)
            other.save_pretrained(weights)  # the files at model.path change mid-run
            ray.kill(reference.pool.actors[0], no_restart=True)
            with pytest.raises(RayRuntimeError, match="changed during the run"):
                reference.logprobs(batch)
            assert reference.fingerprint() == started  # what a checkpoint records stays the start's
        finally:
            reference.close()
    finally:
        placement.remove()
