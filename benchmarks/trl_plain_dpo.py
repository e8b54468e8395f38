"""TRL's DPOTrainer driven plainly, as a TRL user writes it: the reference for the harness.

Nothing of rltune is imported: the model is a directory path handed to ``DPOTrainer``
(which makes the reference model from it, its log-probs computed during training as TRL
does by default), the pairs are jsonl files, and the figures are the ones TRL reports:
``train_samples_per_second`` (pairs per second over ``train()``) and, after training,
``eval_rewards/accuracies`` on the held-out pairs. The arguments are the settings
``dpo_vs_trl.py`` shares between the sides (pairs per step, learning rate and constant
schedule, beta, fp32); everything else is TRL's default, except gradient checkpointing,
which a CPU user with a small model turns off and the benchmark turns off on both sides.

    python benchmarks/trl_plain_dpo.py MODEL_DIR TRAIN.jsonl EVAL.jsonl --steps 60
"""

from __future__ import annotations

import argparse
import json

from datasets import load_dataset
from trl import DPOConfig, DPOTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("train")
    parser.add_argument("eval")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--pairs", type=int, default=16, help="pairs per step")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output", default="/tmp/trl_plain_dpo")
    args = parser.parse_args()
    config = DPOConfig(
        output_dir=args.output, use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=args.pairs, per_device_eval_batch_size=args.pairs,
        learning_rate=args.lr, lr_scheduler_type="constant", max_steps=args.steps,
        beta=args.beta, report_to="none", save_strategy="no", seed=args.seed,
    )
    trainer = DPOTrainer(
        model=args.model, args=config,
        train_dataset=load_dataset("json", data_files=args.train, split="train"),
        eval_dataset=load_dataset("json", data_files=args.eval, split="train"),
    )
    rate = trainer.train().metrics["train_samples_per_second"]
    accuracy = trainer.evaluate()["eval_rewards/accuracies"]
    print(f"TRL: {rate:.2f} pairs/s, held-out accuracy {accuracy:.3f}")
    print(json.dumps({"impl": "trl-plain", "unit": "pairs/s", "rate": rate,
                      "trl_own_rate": rate, "quality": accuracy}))


if __name__ == "__main__":
    main()
