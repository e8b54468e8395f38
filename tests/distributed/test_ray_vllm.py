"""The vLLM generator as a Ray actor (``rollout.engine: vllm``, ``runtime.mode: ray``):
with either weight sync, at every step the engine samples with the learner's newest
weights (its log-probs of the sampled tokens are the learner's), taken in place from
Ray's object store or bucket by bucket from the broadcast channel. Skipped, with the
reason, where vLLM or Ray is not installed; ``make test-vllm`` runs it on vLLM's CPU
build."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed")

from rltune.config import load_config  # noqa: E402
from rltune.models.load import resolve_model  # noqa: E402
from rltune.rollout.vllm import vllm_missing  # noqa: E402
from rltune.runtime.build import build_run as build_with_roles  # noqa: E402
from rltune.runtime.loop import train  # noqa: E402
from rltune.runtime.ray.cluster import place  # noqa: E402
from rltune.runtime.ray.roles import RayRoles  # noqa: E402

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))

REWARD = '''
def digit_share(prompt, completion, **meta):
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))
'''


@pytest.mark.parametrize("weight_sync", ["object_store", "broadcast"])
def test_the_vllm_actor_samples_with_the_learners_weights(ray_cluster, tmp_path: Path, weight_sync: str) -> None:
    (tmp_path / "rewards.py").write_text(REWARD)
    model = resolve_model("builtin:tiny", cache_dir=str(tmp_path / "builtin"))
    cfg = load_config(None, [
        f"name={weight_sync}", f"model.path={model}", "algo.name=grpo", "algo.group_size=4",
        "data.train=builtin:arith_small/train", f"reward.0.fn={tmp_path / 'rewards.py'}:digit_share",
        "rollout.max_new_tokens=8", "train.steps=5", "train.prompts_per_step=4", "train.lr=1e-3",
        f"log.dir={tmp_path / 'runs'}", "log.console=false", "checkpoint.final=false",
        "runtime.mode=ray", f"runtime.weight_sync={weight_sync}", "rollout.engine=vllm",
        "rollout.vllm.max_model_len=128", "rollout.vllm.engine_args.kv_cache_memory_bytes=268435456",
    ])
    placement = place(cfg.runtime.placement, name=f"test-vllm-{weight_sync}")
    roles = RayRoles(placement, None, Path(cfg.log.dir) / cfg.name)
    try:
        run = build_with_roles(cfg, roles)
        history = train(run)
        assert run.generator.version == run.learner.version == 5
    finally:
        roles.close()
        placement.remove()
    mismatch = [m["logprob_mismatch"] for m in history]
    assert max(mismatch) < 1e-3, mismatch
    assert history[-1]["time/weight_load"] > 0
