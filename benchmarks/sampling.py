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

``--check``: instead of timing, draw from the GRPO benchmark's untrained 3 M Qwen2
(``trl_common.SIZES``): its next-token distributions after 64 random 20-token contexts,
4,000 draws each with ``sample_next``; prints how often EOS was drawn against its mean
probability (a z-score) and the mean squared z-score of every (context, token) count
against its binomial expectation (1 for a sampler that draws the distribution).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rltune.rollout.sampling import sample_next


def multinomial_draw(logits: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_next`` at temperature 1 with ``torch.multinomial`` for the draw."""
    logp_all = torch.log_softmax(logits, dim=-1)
    tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def check_against_model(contexts: int = 64, draws: int = 4_000) -> None:
    """``--check`` (see the module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trl_common as common
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rltune.models.tiny import build_tiny

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny(Path(tmp), **common.SIZES["3m"])
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        eos = AutoTokenizer.from_pretrained(tmp).eos_token_id
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        logits = model(torch.randint(3, model.config.vocab_size, (contexts, 20), generator=generator)).logits[:, -1]
    probs = torch.softmax(logits, dim=-1).double()  # [contexts, V]
    tokens, _ = sample_next(logits.repeat_interleave(draws, 0), temperature=1.0, generator=generator)
    counts = torch.zeros_like(probs).scatter_add_(1, tokens.view(contexts, draws),
                                                  torch.ones(contexts, draws, dtype=probs.dtype))
    drawn, expected = float(counts[:, eos].sum()) / (contexts * draws), float(probs[:, eos].mean())
    sd = math.sqrt(float((probs[:, eos] * (1 - probs[:, eos])).sum()) / draws) / contexts
    z = (counts / draws - probs) / (probs * (1 - probs) / draws).sqrt()
    print(f"{contexts} contexts x {draws} draws, 3 M model, vocabulary {probs.shape[1]}")
    print(f"EOS drawn {drawn:.5f} of the time, expected {expected:.5f}: z = {(drawn - expected) / sd:+.2f}")
    print(f"mean squared z over {z.numel()} (context, token) counts: {float((z ** 2).mean()):.4f} "
          f"(1 expected), largest |z| {float(z.abs().max()):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--vocab", type=int, nargs="+", default=[260, 32_000, 152_064])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--check", action="store_true", help="check the draws against a model's distributions")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.check:
        check_against_model()
        return
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
