"""DPO throughput and learning, rltune against TRL 1.16, on the same CPU, model and pairs.

Every side trains the same untrained Qwen2 (``--model 3m`` or ``25m``, built locally)
with sigmoid DPO (beta 0.1) on arithmetic preference pairs (``builtin:arith_prefs``:
chosen the sum, rejected a careless mistake; ``--steps`` x 16 train pairs, one epoch,
written once to jsonl), plain-text prompts, AdamW at a constant learning rate, gradient
clip 1.0, fp32, no gradient checkpointing. In each round the rltune and trl sides read
the pairs in the same order (a copy shuffled with the round's seed, read in file order:
``data.shuffle=false``, TRL's ``train_sampling_strategy="sequential"``): with each
library's own shuffle the held-out accuracy differed by the order alone. Each side
computes the reference log-probs as it normally does: TRL with a frozen copy of the
model during training (``precompute_ref_log_probs`` off, its default); rltune once
before training, over the train pairs, with the policy itself (``algo.name=dpo``).

Sides, each in a fresh process, interleaved round by round (see ``trl_common``):

- ``trl``: TRL's DPOTrainer with those settings and TRL's defaults otherwise, the model
  given as its directory.
- ``rltune``: ``algo.name=dpo`` with the same settings.
- ``trl-plain``: ``trl_plain_dpo.py``, the same TRL run written plainly (TRL's own
  figures), showing the harness runs TRL at its own speed.

Speed is pairs per second over the whole training: the pairs divided by the time of
TRL's ``train()``, or of rltune's reference pass plus all its steps (model loading and
tokenising are outside on both sides). Learning per sample is held-out pair accuracy
after the same pairs, on ``--eval-pairs`` pairs of ``arith_prefs/eval``, judged by one
function for both sides (``trl_common.pair_accuracy``); ``trl-plain`` reports TRL's own
``eval_rewards/accuracies``.

    python benchmarks/dpo_vs_trl.py                    # 3 M model, 3 rounds
    python benchmarks/dpo_vs_trl.py --model 25m
    python benchmarks/dpo_vs_trl.py --only rltune --repeats 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_common as common  # noqa: E402

PAIRS = 16
BETA = 0.1
SIDES = ("trl", "rltune", "trl-plain")


def run_rltune(args: argparse.Namespace, work: Path) -> dict:
    """rltune's DPO in this process: the reference pass is timed, the model exported."""
    import rltune.runtime.preference as preference
    from rltune.config import load_config
    from rltune.runtime.local import run_local

    spent: list[float] = []
    compute = preference.cached_reference

    def timed_reference(*a, **kw):
        start = time.perf_counter()
        try:
            return compute(*a, **kw)
        finally:
            spent.append(time.perf_counter() - start)

    preference.cached_reference = timed_reference
    cfg = load_config(None, [
        "name=bench", f"model.path={args.model_dir}", "algo.name=dpo", f"algo.beta={BETA}",
        f"data.train={args.train}", "data.shuffle=false", "data.chat_template=false",
        f"train.steps={args.steps}",
        f"train.prompts_per_step={PAIRS}", f"train.lr={args.lr}", f"log.dir={work}",
        f"train.seed={args.seed}", "log.console=false", *args.rltune_set, "checkpoint.final=true",
    ])
    run = run_local(cfg)
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(run.run_dir / "final")
    seconds = sum(spent) + sum(m["time/step"] for m in run.history)
    return {"seconds": seconds, "reference_s": sum(spent), "policy": policy}


def run_trl(args: argparse.Namespace, work: Path) -> dict:
    """TRL's DPOTrainer in this process; ``train()`` is timed."""
    from datasets import load_dataset
    from trl import DPOConfig, DPOTrainer

    settings = dict(
        output_dir=str(work / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=PAIRS, learning_rate=args.lr, lr_scheduler_type="constant",
        max_steps=args.steps, beta=BETA, train_sampling_strategy="sequential", report_to="none",
        save_strategy="no", seed=args.seed,
    )
    trainer = DPOTrainer(
        model=str(args.model_dir), args=DPOConfig(**{**settings, **common.parse_sets(args.trl_set)}),
        train_dataset=load_dataset("json", data_files=str(args.train), split="train"),
    )
    start = time.perf_counter()
    metrics = trainer.train().metrics
    return {"seconds": time.perf_counter() - start, "policy": trainer.model,
            "trl_own_rate": metrics["train_samples_per_second"]}


def child(args: argparse.Namespace) -> None:
    """Run one side, judge its model on the held-out pairs; JSON on the last line."""
    with tempfile.TemporaryDirectory() as work:
        out = {"rltune": run_rltune, "trl": run_trl}[args.child](args, Path(work))
        accuracy = common.pair_accuracy(out.pop("policy"), args.model_dir, common.read_jsonl(args.eval))
    import torch

    out["threads"] = torch.get_num_threads()  # what the side ran with, after its own setup
    out.update(impl=args.child, unit="pairs/s", rate=args.steps * PAIRS / out["seconds"],
               quality=accuracy)
    print(json.dumps(out))


def side_argv(side: str, args: argparse.Namespace, seed: int) -> list[str]:
    """The command line of one side's child process."""
    if side == "trl-plain":
        return [sys.executable, str(Path(__file__).with_name("trl_plain_dpo.py")),
                str(args.model_dir), str(args.train), str(args.eval), "--steps", str(args.steps),
                "--pairs", str(PAIRS), "--lr", str(args.lr), "--beta", str(BETA),
                "--output", str(args.model_dir.parent / "trl_plain"), "--seed", str(seed)]
    return [sys.executable, __file__, "--child", side, "--seed", str(seed),
            "--model-dir", str(args.model_dir),
            "--train", str(common.shuffled_copy(args.train, seed)), "--eval", str(args.eval),
            "--steps", str(args.steps),
            "--lr", str(args.lr), *[f"--trl-set={s}" for s in args.trl_set],
            *[f"--rltune-set={s}" for s in args.rltune_set]]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(common.SIZES), default="3m")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-pairs", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, help="torch threads on every side "
                        "(default: torch's default, as a user runs it)")
    parser.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one DPOConfig field on the trl side (not on trl-plain)")
    parser.add_argument("--rltune-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one rltune config key on the rltune side (not on "
                             "trl-plain), e.g. algo.aggregation=seq-mean-token-mean")
    parser.add_argument("--only", choices=SIDES, help="run one side, --repeats times")
    parser.add_argument("--child", choices=("rltune", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    for hidden in ("--model-dir", "--train", "--eval"):
        parser.add_argument(hidden, type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse()
    if args.child:
        child(args)
        return
    keep = ("prompt", "chosen", "rejected")
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = common.prepare(Path(tmp), args.model, {
            "train.jsonl": ("arith_prefs", "train", args.steps * PAIRS, keep),
            "eval.jsonl": ("arith_prefs", "eval", args.eval_pairs, keep)})
        args.train, args.eval = Path(tmp) / "train.jsonl", Path(tmp) / "eval.jsonl"
        env = common.child_env(args.threads)
        sides = [args.only] if args.only else list(SIDES)
        results = common.interleave(
            sides, args.repeats, lambda s, seed: common.run_child(side_argv(s, args, seed), env, s))
    common.report(results, unit="pairs/s", quality="held-out pair accuracy", target=1.5)


if __name__ == "__main__":
    main()
