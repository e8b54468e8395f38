"""Peak memory and step time per memory technique: one GRPO learner step at 2,048 tokens.

The model: a Qwen2 built locally (``rltune.models.tiny.build_tiny``: hidden 256, 8 layers,
8 heads, 2 KV heads, intermediate 1,024) whose vocabulary is then widened to Qwen's
151,936 (the byte tokenizer uses ids < 260; the head and embedding have Qwen's size):
46.5 M parameters, 39 M of them the tied embedding. The batch: 2 rows x (48 prompt +
2,000 completion) tokens, fixed (seeded), advantages +1 and -1 per row (with
``--zero-half``-style selective backprop, half the rows get advantage 0).

Every configuration is a list of config overrides (the CLI's ``key=value``) applied to the
same code path the trainer uses: ``load_config`` -> ``load_policy`` -> ``build_objective``
-> ``LocalLearner(..., **learner_options(...))``, each in its own process, one warm-up
step then ``--steps`` timed steps; the process reports its peak RSS
(``ru_maxrss``) and the median step time. A configuration whose key the config or the
learner refuses prints ``n/a (reason)``.

Usage::

    python benchmarks/memory_table.py --steps 2
    python benchmarks/memory_table.py --only baseline chunked-off --steps 1
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

VOCAB = 151_936
PROMPT, COMPLETION, ROWS = 48, 2000, 2

CONFIGS: dict[str, list[str]] = {
    "baseline fp32": [],
    "bf16": ["train.precision=bf16"],
    "fp16": ["train.precision=fp16"],
    "act. ckpt full": ["train.activation_checkpointing=full"],
    "act. ckpt selective": ["train.activation_checkpointing=selective"],
    "offload optimizer": ["train.offload=optimizer"],
    "chunked log-probs off": ["train.logprob_chunk_tokens=0"],
    "chunked log-probs 256": ["train.logprob_chunk_tokens=256"],
    "selective backprop": ["algo.skip_zero_advantage=true"],
}
"""Name -> overrides. The baseline has the defaults: fp32, no checkpointing or offload,
log-probs in chunks of ``train.logprob_chunk_tokens`` (1,024), selective backprop off."""


def build_model(directory: Path) -> str:
    """The table's model in ``directory`` (built once, reused)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rltune.models.tiny import build_tiny

    if (directory / "config.json").exists():
        return str(directory)
    build_tiny(directory, seed=0, arch="qwen2", hidden_size=256, layers=8, heads=8, kv_heads=2)
    config = AutoConfig.from_pretrained(directory)
    config.vocab_size = VOCAB
    import torch

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return str(directory)


def make_batch(zero_half: bool):
    import torch

    from rltune.data.records import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 260, (ROWS, PROMPT + COMPLETION), generator=g)
    mask = torch.ones_like(ids)
    loss_mask = mask[:, PROMPT:].float()
    signs = torch.tensor([1.0, -1.0])[torch.arange(ROWS) % 2]
    if zero_half:
        signs[ROWS // 2:] = 0.0
    advantages = signs[:, None].expand_as(loss_mask).clone()
    old = torch.full_like(loss_mask, -5.0)
    return TrainBatch(input_ids=ids, attention_mask=mask, prompt_len=PROMPT, loss_mask=loss_mask,
                      advantages=advantages, old_logprobs=old)


def child(model_dir: str, overrides: list[str], steps: int, threads: int) -> dict:
    """One configuration: the learner as the trainer builds it, warm-up + ``steps`` steps."""
    import resource

    import torch

    from rltune.algos import ALGORITHMS
    from rltune.config.load import load_config
    from rltune.learner.learner import LocalLearner
    from rltune.learner.objectives import build_objective
    from rltune.runtime.roles import learner_options, load_policy

    torch.set_num_threads(threads)
    try:
        cfg = load_config(None, [f"model.path={model_dir}", "algo.name=grpo", "algo.kl_coef=0",
                                 "train.micro_batch_tokens=8192", *overrides])
        algorithm = ALGORITHMS["grpo"]
        model = load_policy(cfg, model_dir)
        objective = build_objective(algorithm, cfg.algo, max_len=cfg.rollout.max_new_tokens)
        learner = LocalLearner(model, objective, cfg.train, **learner_options(cfg, algorithm, model))
    except Exception as err:  # a key not implemented, or refused in this combination
        return {"na": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    batch = make_batch("algo.skip_zero_advantage=true" in overrides)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        learner.step(batch)
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": peak, "step_s": statistics.median(times),
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="configuration names (substring match)")
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "rltune_memory_table_model"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        overrides = json.loads(args.child)
        print(json.dumps(child(args.model_dir, overrides, args.steps, args.threads)))
        return
    model_dir = build_model(Path(args.model_dir))
    names = [n for n in CONFIGS if args.only is None or any(o in n for o in args.only)]
    print(f"Qwen2 hidden 256, 8 layers, vocab {VOCAB}; {ROWS} rows x ({PROMPT} + {COMPLETION}) tokens; "
          f"GRPO, no KL; warm-up + {args.steps} steps; {args.threads} threads")
    print(f"| configuration | overrides | peak RSS (MiB) | step time (s) |\n|---|---|---|---|")
    for name in names:
        cmd = [sys.executable, __file__, "--child", json.dumps(CONFIGS[name]), "--model-dir", model_dir,
               "--steps", str(args.steps), "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
            result = {"na": f"failed ({done.returncode}): {tail}"}
        else:
            result = json.loads(lines[-1])
        shown = " ".join(CONFIGS[name]) or "(defaults)"
        if "na" in result:
            print(f"| {name} | `{shown}` | n/a ({result['na']}) | n/a |", flush=True)
        else:
            print(f"| {name} | `{shown}` | {result['peak_mb']:.0f} | {result['step_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
