"""Time of one token's draw: rltune's sampler against ``torch.multinomial``, interleaved.

``rltune.rollout.sampling.sample_next`` draws by inverting each row's cumulative
distribution (one float64 uniform number a row); the alternative is the same function
with ``torch.multinomial`` for the draw, as it was before and as transformers' ``generate``
samples. Both take the temperature-scaled log-softmax (the log-prob they report) from
the same logits. Rows and vocabulary sizes: the GRPO benchmark's 8 rows, and the
vocabularies of the built-in byte tokenizer (260), Llama 2 (32,000) and Qwen2 (152,064).
The two take turns call by call; medians over ``--repeats`` rounds::

    python benchmarks/sampling.py
    python benchmarks/sampling.py --threads 1 --rows 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rltune.rollout.sampling import sample_next


def multinomial_draw(logits: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_next`` at temperature 1 with ``torch.multinomial`` for the draw."""
    logp_all = torch.log_softmax(logits, dim=-1)
    tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--vocab", type=int, nargs="+", default=[260, 32_000, 152_064])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    sides = {
        "torch.multinomial": lambda logits: multinomial_draw(logits, generator),
        "rltune inverse cdf": lambda logits: sample_next(logits, temperature=1.0, generator=generator),
    }
    print(f"{args.rows} rows, torch threads {torch.get_num_threads()}, wall clock, medians of {args.repeats}")
    for vocab in args.vocab:
        logits = torch.randn(args.rows, vocab, generator=generator) * 3
        calls = max(1, 2_000_000 // (args.rows * vocab))  # ~2 M entries a round per side
        times: dict[str, list[float]] = {name: [] for name in sides}
        for name, draw in sides.items():  # warm-up
            draw(logits)
        for _ in range(args.repeats):
            for name, draw in sides.items():
                start = time.perf_counter()
                for _ in range(calls):
                    draw(logits)
                times[name].append((time.perf_counter() - start) / calls)
        base, ours = (statistics.median(times[name]) for name in sides)
        print(f"vocabulary {vocab:>7}: multinomial {base * 1e6:9.1f} us, inverse cdf {ours * 1e6:9.1f} us "
              f"a token ({base / ours:.1f}x)")


if __name__ == "__main__":
    main()
