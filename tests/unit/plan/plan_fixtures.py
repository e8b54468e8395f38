"""Small model shapes and workloads shared by the planner's search and report tests."""

from __future__ import annotations

from rltune.plan.spec import ModelSpec, Workload

SMALL = ModelSpec(name="small", hidden=1024, layers=4, heads=8, kv_heads=4, head_dim=128,
                  intermediate=4096, vocab=32000)
SMALL_MOE = ModelSpec(name="small-moe", hidden=1024, layers=4, heads=8, kv_heads=4, head_dim=128,
                      intermediate=4096, vocab=32000, experts=4, experts_per_token=2, expert_intermediate=1024)


def grpo(**changes) -> Workload:
    """GRPO, 8 prompts x 4 samples, 256 + 256 tokens, bf16."""
    base = dict(algo="grpo", generates=True, critic=False, reference=False, prompts_per_step=8, group_size=4,
                prompt_tokens=256, completion_tokens=256)
    return Workload(**(base | changes))
