"""Peak memory of the log-probs' forward and backward: full logits against chunks.

A small Qwen2 with Qwen's vocabulary (151,936; hidden 256, 2 layers, 4 heads, 2 KV heads,
tied embeddings, fp32, ~41 M parameters, almost all of them the embedding) scores one row
of 16 prompt + 2,048 completion tokens: ``completion_logprobs`` with entropy, then the
backward of the summed log-probs. Each setting runs in its own fresh process, which
reports its peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after
the forward and backward, the peak before them (model, batch and interpreter), and the
time of the forward + backward. One float32 ``[1, 2048, V]`` tensor is 1.24 GB.

``--chunks 0`` is today's full-logits path (the head on all completion positions at
once, ``logits_to_keep``); any other value is ``train.logprob_chunk_tokens``. Settings
run interleaved (0, 1024, 256, 0, 1024, 256, ...) so that machine noise hits each alike;
the peak is the largest over the repeats (it hardly varies), the time the median.

Usage::

    python benchmarks/logprob_memory.py
    python benchmarks/logprob_memory.py --chunks 0 1024 256 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

VOCAB = 151_936
PROMPT, COMPLETION = 16, 2048


def child(chunk: int, threads: int, hidden: int, layers: int) -> dict:
    """One setting in this process: build, score, backward; peak RSS and time."""
    import resource

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rltune.models.logprobs import completion_logprobs

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (1, PROMPT + COMPLETION))
    mask = torch.ones_like(ids)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = completion_logprobs(model, ids, mask, PROMPT, with_entropy=True, chunk_tokens=chunk)
    out.logprobs.sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"chunk": chunk, "peak_mb": peak / 1024, "before_mb": before / 1024, "seconds": seconds,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "logp_sum": float(out.logprobs.sum())}


def run_child(chunk: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", str(chunk), "--threads", str(args.threads),
           "--hidden", str(args.hidden), "--layers", str(args.layers)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"chunk={chunk} child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 1024, 256],
                        help="0: full logits; N: train.logprob_chunk_tokens")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.threads, args.hidden, args.layers)))
        return
    runs: dict[int, list[dict]] = {c: [] for c in args.chunks}
    for _ in range(args.repeats):
        for chunk in args.chunks:
            runs[chunk].append(run_child(chunk, args))
    first = runs[args.chunks[0]][0]
    print(f"Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {VOCAB}, {first['params_m']:.1f} M params, "
          f"1 row x ({PROMPT} prompt + {COMPLETION} completion) tokens, fp32, forward + backward, "
          f"{args.threads} threads, {args.repeats} run(s) each")
    print(f"one float32 [1, {COMPLETION}, V] tensor: {COMPLETION * VOCAB * 4 / 2**20:.0f} MiB")
    base = max(r["peak_mb"] for r in runs[args.chunks[0]])
    print(f"{'setting':>16} {'peak RSS MiB':>13} {'before MiB':>11} {'peak - before':>14} "
          f"{'fwd+bwd s':>10} {'peak / first':>13}")
    for chunk in args.chunks:
        peak = max(r["peak_mb"] for r in runs[chunk])
        before = max(r["before_mb"] for r in runs[chunk])
        seconds = statistics.median(r["seconds"] for r in runs[chunk])
        label = "full logits" if chunk == 0 else f"chunks of {chunk}"
        print(f"{label:>16} {peak:13.0f} {before:11.0f} {peak - before:14.0f} {seconds:10.2f} {peak / base:13.2f}")
    sums = {c: runs[c][0]["logp_sum"] for c in args.chunks}
    print("sum of log-probs per setting (the same up to float32 rounding):",
          ", ".join(f"{c}: {v:.4f}" for c, v in sums.items()))


if __name__ == "__main__":
    main()
