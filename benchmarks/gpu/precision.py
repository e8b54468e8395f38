"""The learner's precisions on one GPU: step time, peak memory and the engine-learner
log-prob mismatch of a 1B-class Qwen2. Run by ``benchmarks/gpu/precision.sh`` (never CI).

For each of ``--precisions`` (default bf16, fp16, fp8; ``NAME+compile``: the same with
``train.compile: true``, whose first warm-up step compiles), each in its own ``try`` so
that one failing (fp8 without torchao, an old GPU) does not stop the others:

* **step**: a GRPO learner step (``LocalLearner``, master weights fp32, AdamW) on
  ``--rows`` x ``--seq`` synthetic tokens, one micro-batch; the median of ``--steps``
  timed steps after two warm-ups, and ``torch.cuda.max_memory_allocated`` over them.
* **mismatch**: rltune's HF generator (``HFGenerator`` with ``precision=`` the run's
  generator precision, as ``rollout.precision: auto`` chooses it) samples
  ``--gen-rows`` completions of ``--gen-tokens`` tokens from random prompts; the learner
  at that precision scores the same tokens (``LocalLearner.logprobs``). Reported: the
  mean |generator - learner| log-prob per token (the run's ``logprob_mismatch``), and
  each side's mean |. - fp32| against the fp32 forward of the same weights.

The model (hidden 2048, 20 layers, 16 heads, 8 KV heads, MLP 5632, vocabulary 32768,
untied: about 1.0 B parameters) is built from its config with random weights (nothing is
downloaded); ``--size tiny`` is a small one for a CPU trial of this script. A random
model's next-token distributions are much flatter than a trained one's, so the mismatch
figures compare precisions with one another, not with a real run's.

    python benchmarks/gpu/precision.py --out results.json
    python benchmarks/gpu/precision.py --size tiny --device cpu --precisions fp32 bf16 fp16
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import traceback

import torch

SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=16,
               num_key_value_heads=8, vocab_size=32768),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
EOS = 2  # a token id the random prompts never contain


class _Tokenizer:
    """What HFGenerator asks of a tokenizer; the texts are not measured."""

    pad_token_id = 0
    eos_token_id = EOS

    def batch_decode(self, tokens, skip_special_tokens: bool = True) -> list[str]:
        return [""] * len(tokens)


def build_model(size: str, device: torch.device):
    """A Qwen2 of ``SIZES[size]``, fp32, random weights (seed 0), on ``device``."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=False,
                         eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=0)
    return model


def make_learner(model, precision: str, compile: bool = False):
    from rltune.algos import ALGORITHMS
    from rltune.config.schema import AlgoConfig
    from rltune.config.train import TrainConfig
    from rltune.learner.learner import LocalLearner
    from rltune.learner.objectives import build_objective

    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo"))
    cfg = TrainConfig(lr=1e-6, precision=precision, micro_batch_tokens=1 << 20, grad_clip=1.0, compile=compile)
    return LocalLearner(model, objective, cfg)


def step_batch(vocab: int, rows: int, seq: int, prompt: int):
    from rltune.data.records import TrainBatch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    completion = seq - prompt
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_len=prompt,
                      loss_mask=torch.ones(rows, completion),
                      advantages=torch.randn(rows, generator=g)[:, None].expand(rows, completion).contiguous())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_steps(learner, batch, steps: int, device: torch.device) -> dict:
    """Median step seconds over ``steps`` after two warm-ups; peak memory over the timed ones."""
    for _ in range(2):
        learner.step(batch)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, metrics = [], {}
    for _ in range(steps):
        start = time.perf_counter()
        metrics = learner.step(batch)
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    scale = metrics.get("train/loss_scale")
    return {"step_s": statistics.median(times), "peak_gib": peak,
            "loss_scale": None if scale is None else float(scale.value)}


def measure_mismatch(learner, model, exact_model, precision: str, args, device: torch.device) -> dict:
    """Generator vs learner log-probs on the generator's own samples (see the module
    docstring); ``exact_model``: the same weights unconverted (fp8 converts ``model``'s
    linears in place), whose fp32 forward both sides are measured against."""
    from rltune.data.collate import collate_rollouts
    from rltune.data.records import Prompt, SamplingParams
    from rltune.learner.learner import predict
    from rltune.learner.objectives import logprobs_only
    from rltune.rollout.hf import HFGenerator

    gen_precision = "bf16" if precision == "fp8" else precision
    g = torch.Generator().manual_seed(2)
    prompts = [Prompt(id=str(i), text="", input_ids=torch.randint(3, model.config.vocab_size, (16,),
                                                                  generator=g).tolist())
               for i in range(args.gen_rows)]
    generator = HFGenerator(model, _Tokenizer(), rng=torch.Generator(device).manual_seed(3),
                            precision=gen_precision)
    rollouts = generator.generate(prompts, SamplingParams(n=1, max_new_tokens=args.gen_tokens, temperature=1.0))
    batch = collate_rollouts(rollouts, pad_id=0)
    mask = batch.loss_mask.to(device)
    engine = batch.behaviour_logprobs.to(device)
    learner_lp = learner.logprobs(_on(batch, device))  # one process: the learner does not place batches
    exact = predict(exact_model.eval(), logprobs_only, _on(batch, device), "logprobs", budget=1 << 20)

    def gap(a, b) -> float:
        return float(((a - b).abs() * mask).sum() / mask.sum())

    return {"mismatch": gap(engine, learner_lp), "engine_vs_fp32": gap(engine, exact),
            "learner_vs_fp32": gap(learner_lp, exact), "gen_precision": gen_precision,
            "tokens": int(mask.sum())}


def _on(batch, device: torch.device):
    from rltune.learner.distributed import to_device

    return to_device(batch, device)


def run_one(name: str, args, device: torch.device) -> dict:
    precision, _, option = name.partition("+")
    if option not in ("", "compile"):
        raise ValueError(f"{name!r}: a precision, or one followed by +compile")
    model = build_model(args.size, device)
    exact_model = copy.deepcopy(model) if precision == "fp8" else model
    learner = make_learner(model, precision, compile=option == "compile")
    row = {"precision": name}
    row.update(measure_mismatch(learner, model, exact_model, precision, args, device))
    del exact_model  # not in the step's peak memory
    batch = _on(step_batch(model.config.vocab_size, args.rows, args.seq, prompt=args.seq // 8), device)
    row.update(measure_steps(learner, batch, args.steps, device))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp16", "fp8"])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gen-rows", type=int, default=16)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in the reference forward
        print(f"GPU: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), "
              f"torch {torch.__version__}", flush=True)
    rows = []
    for precision in args.precisions:
        try:
            rows.append(run_one(precision, args, device))
        except Exception as err:  # each precision on its own: report and go on
            traceback.print_exc()
            rows.append({"precision": precision, "error": f"{type(err).__name__}: {err}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


def print_table(rows: list[dict], args) -> None:
    print(f"\n{args.size} Qwen2, GRPO step on {args.rows} x {args.seq} tokens; mismatch on "
          f"{args.gen_rows} x {args.gen_tokens} sampled tokens")
    print(f"{'precision':12s} {'step s':>8s} {'peak GiB':>9s} {'mismatch':>10s} {'engine-fp32':>12s} "
          f"{'learner-fp32':>13s} {'loss scale':>11s}")
    for r in rows:
        if "error" in r:
            print(f"{r['precision']:12s} error: {r['error']}")
            continue
        scale = "-" if r["loss_scale"] is None else f"{r['loss_scale']:.0f}"
        print(f"{r['precision']:12s} {r['step_s']:8.3f} {r['peak_gib']:9.2f} {r['mismatch']:10.2e} "
              f"{r['engine_vs_fp32']:12.2e} {r['learner_vs_fp32']:13.2e} {scale:>11s}")


if __name__ == "__main__":
    raise SystemExit(main())
