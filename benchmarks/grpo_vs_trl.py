"""GRPO throughput, rltune against TRL, on the same CPU, model and settings.

Both sides train the same untrained ~3 M-parameter Qwen2 (built locally, byte-level
tokenizer) with GRPO: 8 completions per step (one prompt, a group of 8), up to 32 new
tokens at temperature 1, no KL term, one optimizer step per batch, fp32, AdamW at the same
learning rate. An untrained model rarely emits EOS, so nearly every completion is 32 tokens
long on both sides. Each side runs in its own process; the figure is completions per
second over the steps after a warm-up (median step time).

    python benchmarks/grpo_vs_trl.py            # both, then the ratio
    python benchmarks/grpo_vs_trl.py --only rltune

TRL is the ``bench`` extra (``pip install 'rltune[bench]'``). TRL's gradient checkpointing
(on by default) is switched off so that neither side recomputes activations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUP = 8
NEW_TOKENS = 32
LR = 1e-5
MODEL = dict(arch="qwen2", hidden_size=256, layers=3, heads=4, kv_heads=2)


def build_model(directory: Path) -> Path:
    from rltune.models.tiny import build_tiny, count_parameters

    build_tiny(directory, seed=0, **MODEL)
    from transformers import AutoModelForCausalLM

    params = count_parameters(AutoModelForCausalLM.from_pretrained(directory))
    print(f"model: Qwen2 {params / 1e6:.2f} M parameters", file=sys.stderr)
    return directory


def prompts() -> list[dict[str, str]]:
    from rltune.data.tasks import TASKS

    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in TASKS["arith"]("train")]


def run_rltune(model_dir: Path, steps: int, work: Path) -> list[float]:
    from rltune.config import load_config
    from rltune.runtime.local import build_run
    from rltune.runtime.loop import train

    cfg = load_config(None, [
        "name=bench", f"model.path={model_dir}", "algo.name=grpo", f"algo.group_size={GROUP}",
        "data.train=builtin:arith/train", "data.chat_template=false",
        "reward.0.fn=builtin:exact_numeric", f"rollout.max_new_tokens={NEW_TOKENS}",
        f"train.steps={steps}", "train.prompts_per_step=1", f"train.lr={LR}",
        f"log.dir={work}", "log.console=false", "checkpoint.final=false",
    ])
    history = train(build_run(cfg))
    return [m["time/step"] for m in history]


def run_trl(model_dir: Path, steps: int, work: Path) -> list[float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rltune.data.records import Prompt
    from rltune.rewards.builtin import exact_numeric

    def reward(prompts, completions, answer, **_):
        return [exact_numeric(Prompt(id="", text=p), c, answer=a) for p, c, a in zip(prompts, completions, answer)]

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    timer = StepTimes()
    args = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=GROUP, num_generations=GROUP,
        max_completion_length=NEW_TOKENS, temperature=1.0, beta=0.0, learning_rate=LR,
        max_steps=steps, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=10**6, gradient_checkpointing=False, seed=0,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(prompts()),
        processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[timer],
    )
    trainer.train()
    return timer.times


RUNNERS = {"rltune": run_rltune, "trl": run_trl}


def child(impl: str, steps: int, model_dir: Path) -> None:
    """Run one side and print its step times as JSON on the last line."""
    with tempfile.TemporaryDirectory() as work:
        times = RUNNERS[impl](model_dir, steps, Path(work))
    print(json.dumps({"impl": impl, "step_times": times}))


def measure(impl: str, steps: int, warmup: int, model_dir: Path) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", impl, "--steps", str(steps), "--model", str(model_dir)],
        check=True, capture_output=True, text=True,
    )
    times = json.loads(out.stdout.strip().splitlines()[-1])["step_times"][warmup:]
    rate = GROUP / statistics.median(times)
    print(f"{impl:>7}: {rate:7.1f} completions/s (median of {len(times)} steps)")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", choices=sorted(RUNNERS))
    parser.add_argument("--child", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.model)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")
        rates = {impl: measure(impl, args.steps, args.warmup, model_dir)
                 for impl in ([args.only] if args.only else ["trl", "rltune"])}
    if len(rates) == 2:
        print(f"rltune / trl: {rates['rltune'] / rates['trl']:.2f}x")


if __name__ == "__main__":
    main()
