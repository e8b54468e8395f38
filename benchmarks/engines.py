"""rltune's sampler against vLLM (``rollout.engine`` hf and vllm), same model, data and
settings: GRPO on the built-in tiny model with the digit-share reward, 8 prompts x 8
samples a step. Per engine and completion length: the reward over the run (first and
last 5 steps), the median seconds a step spends generating (after a warm-up), the
largest gap between the engine's and the learner's log-probs of the sampled tokens (the
engine holds its own copy of the weights, loaded in place after every step), and the
generation time's ratio to ``hf``.

    python benchmarks/engines.py --python .venv-vllm/bin/python   # after `make test-vllm`
    python benchmarks/engines.py --python .venv-vllm/bin/python --tokens 8 32 --steps 30

``--python`` is an interpreter with vLLM installed (the ``vllm`` extra on a GPU machine,
or ``.venv-vllm``, vLLM's CPU build, here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from runs import train_rows

WARMUP = 3


def run(engine: str, tokens: int, steps: int, root: Path, python: str) -> dict[str, float]:
    overrides = [
        "model.path=builtin:tiny", "algo.name=grpo", "algo.group_size=8",
        "data.train=builtin:arith_small/train", f"rollout.max_new_tokens={tokens}",
        f"train.steps={steps}", "train.prompts_per_step=8", "train.lr=1e-3",
        f"rollout.engine={engine}",
    ]
    if engine == "vllm":
        overrides += ["rollout.vllm.max_model_len=128", "rollout.vllm.engine_args.kv_cache_memory_bytes=268435456"]
    rows = train_rows(root, overrides, what=f"rollout.engine={engine}, {tokens} new tokens", python=python)
    rewards = [r["reward/mean"] for r in rows]
    return {
        "reward_first": statistics.mean(rewards[:5]),
        "reward_last": statistics.mean(rewards[-5:]),
        "generate_s": statistics.median(r["time/generate"] for r in rows[WARMUP:]),
        "mismatch": max((r["logprob_mismatch"] for r in rows if "logprob_mismatch" in r), default=float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--python", default=sys.executable, help="an interpreter with vLLM installed")
    args = parser.parse_args()
    print(f"{'tokens':>6} {'engine':>6} {'reward first->last':>18} {'generate s/step':>15} "
          f"{'max logprob gap':>15} {'ratio':>6}")
    for tokens in args.tokens:
        results = {}
        for engine in ("hf", "vllm"):
            with tempfile.TemporaryDirectory() as tmp:
                results[engine] = r = run(engine, tokens, args.steps, Path(tmp), args.python)
            ratio = r["generate_s"] / results["hf"]["generate_s"]
            print(f"{tokens:>6} {engine:>6} {r['reward_first']:>8.2f} -> {r['reward_last']:<6.2f} "
                  f"{r['generate_s']:>15.3f} {r['mismatch']:>15.1e} {ratio:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
