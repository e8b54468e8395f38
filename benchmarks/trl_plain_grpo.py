"""TRL's GRPOTrainer driven plainly, as a TRL user writes it: the reference for the harness.

Nothing of rltune is imported: the model is a directory path handed to ``GRPOTrainer``,
the prompts a jsonl file, the reward a plain function, and the figure is the one TRL
itself reports at the end of ``train()`` (``train_samples_per_second``: completions per
second over the whole run). The arguments are the settings ``grpo_vs_trl.py`` shares
between the sides (group, lengths, learning rate, fp32, no KL, constant schedule);
everything else is TRL's default, except gradient checkpointing, which a CPU user with a
small model turns off (it only recomputes activations) and the benchmark turns off on
both sides.

    python benchmarks/trl_plain_grpo.py MODEL_DIR PROMPTS.jsonl --steps 40 --lr 3e-4
"""

from __future__ import annotations

import argparse
import json
import statistics

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer


def digit_share(completions, **kwargs):
    """The share of each completion's characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output", default="/tmp/trl_plain_grpo")
    args = parser.parse_args()
    config = GRPOConfig(
        output_dir=args.output, use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=args.group, num_generations=args.group,
        max_completion_length=args.new_tokens, learning_rate=args.lr,
        lr_scheduler_type="constant", max_steps=args.steps, beta=0.0,
        report_to="none", save_strategy="no", seed=args.seed, logging_steps=1,
    )
    trainer = GRPOTrainer(
        model=args.model, reward_funcs=digit_share, args=config,
        train_dataset=load_dataset("json", data_files=args.prompts, split="train"),
    )
    metrics = trainer.train().metrics
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    tail = rewards[-max(1, len(rewards) // 4):]
    print(f"TRL: {metrics['train_samples_per_second']:.2f} completions/s, "
          f"reward over the last quarter {statistics.mean(tail):.3f}")
    print(json.dumps({"impl": "trl-plain", "unit": "completions/s",
                      "rate": metrics["train_samples_per_second"],
                      "trl_own_rate": metrics["train_samples_per_second"],
                      "quality": statistics.mean(tail), "rewards": rewards}))


if __name__ == "__main__":
    main()
