"""Activation memory of a GRPO learner step with ``train.activation_checkpointing``.

A small Qwen2 (hidden 256, 8 layers, 4 heads, 2 KV heads, intermediate 1024, vocabulary
1,024, fp32, sdpa attention) takes GRPO steps (``LocalLearner``, one micro-batch) on rows
of 16 prompt + 2,048 completion tokens. Each mode runs in its own fresh process, which
reports:

* ``saved_mb``: the bytes autograd keeps for the backward during the step's forward
  (distinct storages seen by a ``saved_tensors_hooks`` pack hook; the checkpointed
  regions keep only their inputs);
* ``peak_mb`` / ``delta_mb``: the process's peak resident set size during the first step
  (``VmHWM``, reset through ``/proc/self/clear_refs`` just before it; the first, because
  memory a step frees stays resident in the allocator) and its rise above the resident
  size just before the step (model, optimizer, batch, interpreter);
* ``step_s``: the median time of ``--steps`` steps after the first.

Modes run interleaved (none, selective, full, none, ...) so machine noise hits each
alike; the table shows the median of the repeats.

Usage::

    python benchmarks/activation_memory.py
    python benchmarks/activation_memory.py --modes none selective:2 selective:4 full --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = 16


def _status(field: str) -> float:
    """A ``/proc/self/status`` memory field in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def child(mode: str, args: argparse.Namespace) -> dict:
    """One mode in this process: build, warm up, measure one step."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rltune.algos import ALGORITHMS
    from rltune.config.schema import AlgoConfig, TrainConfig
    from rltune.data.records import TrainBatch
    from rltune.learner.learner import LocalLearner
    from rltune.learner.objectives import build_objective

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1024, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=PROMPT + args.tokens, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    name, _, every = mode.partition(":")
    train = {"activation_checkpointing": name, **({"checkpoint_every": int(every)} if every else {})}
    total = PROMPT + args.tokens
    cfg = TrainConfig(lr=1e-5, micro_batch_tokens=args.rows * total, **train)
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo"))
    learner = LocalLearner(model, objective, cfg)
    ids = torch.randint(0, 1024, (args.rows, total))
    batch = TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_len=PROMPT,
                       loss_mask=torch.ones(args.rows, args.tokens),
                       advantages=torch.randn(args.rows, 1).expand(args.rows, args.tokens),
                       old_logprobs=torch.zeros(args.rows, args.tokens))
    batch = dataclasses.replace(batch, old_logprobs=learner.logprobs(batch))  # ratios near 1: no clip
    _reset_peak()  # the first step's peak: the memory freed after a step stays resident
    before = _status("VmRSS")
    learner.step(batch)
    peak = _status("VmHWM")
    times = []
    for _ in range(args.steps):  # timed after the first (warm-up) step
        start = time.perf_counter()
        learner.step(batch)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        learner.step(batch)
    return {"mode": mode, "before_mb": before, "peak_mb": peak, "delta_mb": peak - before,
            "saved_mb": sum(storages.values()) / 2**20, "step_s": seconds,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


def run_child(mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--threads", str(args.threads), "--hidden",
           str(args.hidden), "--layers", str(args.layers), "--tokens", str(args.tokens), "--rows", str(args.rows), "--steps", str(args.steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"mode={mode} child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["none", "selective:2", "full"],
                        help="none, full, selective or selective:K (train.checkpoint_every=K)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048, help="completion tokens per row")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process (median)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args)))
        return
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    for _ in range(args.repeats):
        for mode in args.modes:
            runs[mode].append(run_child(mode, args))
    print(f"Qwen2 hidden {args.hidden}, {args.layers} layers, {runs[args.modes[0]][0]['params_m']:.1f} M params, "
          f"{args.rows} row(s) x ({PROMPT} + {args.tokens}) tokens, fp32, {args.threads} thread(s); "
          f"median of {args.repeats}")
    print(f"{'mode':<14}{'saved for backward MB':>24}{'step RSS rise MB':>20}{'peak RSS MB':>14}{'step s':>9}")
    for mode, results in runs.items():
        med = {k: statistics.median(r[k] for r in results) for k in ("saved_mb", "delta_mb", "peak_mb", "step_s")}
        print(f"{mode:<14}{med['saved_mb']:>24.0f}{med['delta_mb']:>20.0f}{med['peak_mb']:>14.0f}{med['step_s']:>9.2f}")


if __name__ == "__main__":
    main()
