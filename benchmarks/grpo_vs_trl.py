"""GRPO throughput and learning, rltune against TRL 1.16, on the same CPU, model and data.

Every side trains the same untrained Qwen2 (``--model 3m``: 3.0 M parameters, ``25m``:
23.7 M; built locally, byte-level tokenizer) with GRPO on the arithmetic prompts
(``builtin:arith/train``, written once to a jsonl file all sides read): one prompt a step,
a group of 8 completions, up to 32 new tokens at temperature 1, reward = the share of
digits in the completion (see ``trl_common.digit_share``), no KL term, token-mean loss,
ratio clip 0.2, group-std advantages, gradient clip 1.0, AdamW at a constant learning
rate, one optimizer step per batch, fp32, no gradient checkpointing. In each round the
rltune and trl sides read the prompts in the same order (a copy shuffled with the round's
seed, read in file order: ``data.shuffle=false``, ``shuffle_dataset=False``); only the
sampled completions differ between them.

Sides, each in a fresh process, interleaved round by round (see ``trl_common``):

- ``trl``: TRL's GRPOTrainer with those settings and TRL's defaults otherwise, the model
  given as its directory (as a TRL user does); a callback times each step.
- ``rltune``: ``algo.name=grpo`` with the same settings.
- ``trl-plain``: ``trl_plain_grpo.py``, the same TRL run written plainly, no rltune import
  and TRL's own ``train_samples_per_second``: it shows the harness runs TRL at its speed.
- ``rltune-compiled`` (only with ``--compiled-row``): rltune with ``rollout.compile=true``,
  the decode step compiled (on a CPU: one native call a step on oneDNN-packed weights,
  ``rltune/rollout/compiled.py``). The same synchronous algorithm and sampler as
  ``rltune``, so its ratio counts like ``rltune``'s; the first generate call of each run
  compiles (about 20 s with an empty inductor cache, inside the warm-up steps, which the
  median excludes).
- ``rltune-async`` (only with ``--async-row``): rltune with generation one step ahead of
  the learner (``runtime.max_staleness=1``, ``algo.importance_correction=token-truncate``):
  a producer thread generates batch ``s + 1`` while the learner learns batch ``s``, each on
  its own share of the cores (``rollout.threads``). This is not TRL's algorithm (the
  samples are one policy version old, corrected by importance weights), so it is printed as
  its own row and ratio; ``rltune`` remains the synchronous comparison. Its two threads
  split the cores the other sides use whole (``threads 1+1`` on 2 cores); with
  ``--threads N`` each of them runs N threads, 2N in all, so compare it at the default
  thread count, where every side has the whole machine.

Speed is completions per second at the median step time after ``--warmup`` steps, the
median over ``--repeats`` rounds. Learning per sample is the mean training reward over
the last quarter of the steps (the same number of completions on every side).

    python benchmarks/grpo_vs_trl.py                       # 3 M model, 3 rounds
    python benchmarks/grpo_vs_trl.py --model 25m --steps 24
    python benchmarks/grpo_vs_trl.py --only rltune         # rltune's side alone, once
    python benchmarks/grpo_vs_trl.py --async-row           # and rltune-async after rltune
    python benchmarks/grpo_vs_trl.py --compiled-row        # and rltune-compiled after rltune

TRL is the ``bench`` extra (``pip install 'rltune[bench]'``). Two defaults of TRL's that
differ from the shared settings are set explicitly on its side: ``bf16`` (TRL turns it on
by default, also on CPU, where autocast bf16 runs the backward several times slower on a
CPU without native bf16 matmuls) and gradient checkpointing (on by default; it only
recomputes activations); ``lr_scheduler_type="constant"`` matches rltune's constant rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_common as common  # noqa: E402

GROUP = 8
NEW_TOKENS = 32
SIDES = ("trl", "rltune", "trl-plain")
ASYNC_SIDE = "rltune-async"
ASYNC_SETS = ("runtime.max_staleness=1", "algo.importance_correction=token-truncate")
"""The ``rltune-async`` side's overrides: generation one step ahead, and the importance
correction rltune requires for samples of an older policy."""
COMPILED_SIDE = "rltune-compiled"
COMPILED_SETS = ("rollout.compile=true",)
"""The ``rltune-compiled`` side's overrides: the decode step compiled (the same algorithm
and samples as ``rltune``, which runs the default ``rollout.compile: false``)."""
EXTRA_SETS = {ASYNC_SIDE: ASYNC_SETS, COMPILED_SIDE: COMPILED_SETS}


TRL_ADV_EPS = 1e-4
"""TRL's GRPO trainer divides by ``std + 1e-4``; rltune's side sets ``algo.adv_eps`` to it."""


def rltune_overrides(model_dir: Path, prompts: Path, work: Path, *, seed: int, steps: int, lr: float,
                     prompts_per_step: int = 1) -> list[str]:
    """rltune's GRPO config with TRL's settings (``run_trl``'s GRPOConfig)."""
    return [
        "name=bench", f"model.path={model_dir}", "algo.name=grpo",
        f"algo.group_size={GROUP}", f"algo.adv_eps={TRL_ADV_EPS}", f"data.train={prompts}",
        "data.shuffle=false", "data.chat_template=false",
        f"reward.0.fn={common.__file__}:digit_share", f"rollout.max_new_tokens={NEW_TOKENS}",
        f"train.steps={steps}", f"train.prompts_per_step={prompts_per_step}", f"train.lr={lr}",
        f"log.dir={work}", f"train.seed={seed}", "log.console=false", "checkpoint.final=false",
    ]


def run_rltune(args: argparse.Namespace, work: Path, extra: tuple[str, ...] = ()) -> dict:
    """rltune's GRPO in this process; step times and rewards from its history.
    ``extra``: config overrides of this side (before ``--rltune-set``'s)."""
    from rltune.config import load_config
    from rltune.runtime.local import build_run
    from rltune.runtime.loop import train

    base = rltune_overrides(args.model_dir, args.prompts, work, seed=args.seed, steps=args.steps, lr=args.lr)
    cfg = load_config(None, [*base, *extra, *args.rltune_set])
    run = build_run(cfg)
    history = train(run)
    producer = getattr(run.source, "producer", None)  # rollouts ahead of the learner
    return {"step_times": [m["time/step"] for m in history],
            "rewards": [m["reward/mean"] for m in history],
            "producer_threads": producer.threads if producer is not None else None}


def run_trl(args: argparse.Namespace, work: Path) -> dict:
    """TRL's GRPOTrainer in this process; a callback times the steps."""
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rewards: list[float] = []

    def digit_share(completions, **_):
        scores = [common.digit_share(None, c) for c in completions]
        rewards.append(statistics.mean(scores))
        return scores

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    timer = StepTimes()
    settings = dict(
        output_dir=str(work / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=GROUP, num_generations=GROUP,
        max_completion_length=NEW_TOKENS, temperature=1.0, beta=0.0, learning_rate=args.lr,
        lr_scheduler_type="constant", max_steps=args.steps, shuffle_dataset=False,
        report_to="none",
        save_strategy="no", logging_steps=1, seed=args.seed,
    )
    config = GRPOConfig(**{**settings, **common.parse_sets(args.trl_set)})
    trainer = GRPOTrainer(
        model=str(args.model_dir), reward_funcs=digit_share, args=config,
        train_dataset=load_dataset("json", data_files=str(args.prompts), split="train"),
        callbacks=[timer],
    )
    metrics = trainer.train().metrics
    return {"step_times": timer.times, "rewards": rewards,
            "trl_own_rate": metrics["train_samples_per_second"]}


def child(args: argparse.Namespace) -> None:
    """Run one side; print its figures as JSON on the last line."""
    with tempfile.TemporaryDirectory() as work:
        if args.child == "trl":
            out = run_trl(args, Path(work))
        else:
            out = run_rltune(args, Path(work), EXTRA_SETS.get(args.child, ()))
    import torch

    # what the side ran with, after its own setup; "learner+producer" with a producer thread
    producer = out.pop("producer_threads", None)
    out["threads"] = torch.get_num_threads() if producer is None else f"{torch.get_num_threads()}+{producer}"
    times = out["step_times"][args.warmup:]
    tail = out["rewards"][-max(1, len(out["rewards"]) // 4):]
    out.update(impl=args.child, unit="completions/s", rate=GROUP / statistics.median(times),
               quality=statistics.mean(tail))
    print(json.dumps(out))


def side_argv(side: str, args: argparse.Namespace, seed: int) -> list[str]:
    """The command line of one side's child process."""
    if side == "trl-plain":
        return [sys.executable, str(Path(__file__).with_name("trl_plain_grpo.py")),
                str(args.model_dir), str(args.prompts), "--steps", str(args.steps),
                "--group", str(GROUP), "--new-tokens", str(NEW_TOKENS), "--lr", str(args.lr),
                "--output", str(args.model_dir.parent / "trl_plain"), "--seed", str(seed)]
    return [sys.executable, __file__, "--child", side, "--seed", str(seed),
            "--model-dir", str(args.model_dir),
            "--prompts", str(common.shuffled_copy(args.prompts, seed)), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--lr", str(args.lr),
            *[f"--trl-set={s}" for s in args.trl_set],
            *[f"--rltune-set={s}" for s in args.rltune_set]]


def sides_of(async_row: bool, compiled_row: bool = False) -> list[str]:
    """The sides of one round, in order; ``rltune-compiled`` and ``rltune-async`` right
    after ``rltune``."""
    sides = list(SIDES)
    extra = [side for side, wanted in ((COMPILED_SIDE, compiled_row), (ASYNC_SIDE, async_row)) if wanted]
    at = sides.index("rltune") + 1
    sides[at:at] = extra
    return sides


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(common.SIZES), default="3m")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-4,
                        help="AdamW learning rate on every side: the untrained 3 M model's "
                             "reward moves from ~0.05 to ~0.35 in 40 steps, far from 1, so "
                             "a difference in learning per sample shows")
    parser.add_argument("--threads", type=int, help="torch threads on every side "
                        "(default: torch's default, as a user runs it)")
    parser.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one GRPOConfig field on the trl side (not on "
                             "trl-plain), e.g. bf16=true to see TRL's CPU default")
    parser.add_argument("--rltune-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one rltune config key on the rltune side (not on "
                             "trl-plain), e.g. algo.aggregation=seq-mean-token-mean")
    parser.add_argument("--async-row", action="store_true",
                        help=f"also run {ASYNC_SIDE}: rltune with generation one step ahead "
                             f"({', '.join(ASYNC_SETS)}), interleaved after rltune")
    parser.add_argument("--compiled-row", action="store_true",
                        help=f"also run {COMPILED_SIDE}: rltune with rollout.compile=true (the "
                             "decode step compiled; the same synchronous algorithm)")
    parser.add_argument("--only", choices=(*SIDES, ASYNC_SIDE, COMPILED_SIDE), help="run one side, --repeats times")
    parser.add_argument("--child", choices=("rltune", "trl", ASYNC_SIDE, COMPILED_SIDE), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    return args


def main() -> None:
    args = parse()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        files = {"prompts.jsonl": ("arith", "train", None, ("prompt", "answer"))}
        args.model_dir = common.prepare(Path(tmp), args.model, files)
        args.prompts = Path(tmp) / "prompts.jsonl"
        env = common.child_env(args.threads)
        sides = [args.only] if args.only else sides_of(args.async_row, args.compiled_row)
        results = common.interleave(
            sides, args.repeats, lambda s, seed: common.run_child(side_argv(s, args, seed), env, s))
    common.report(results, unit="completions/s", quality="reward, last quarter", target=2.0)


if __name__ == "__main__":
    main()
