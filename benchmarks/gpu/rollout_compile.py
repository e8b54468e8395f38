"""``rollout.compile`` on and off: decode tokens per second of the lean decoder, eager
against its step compiled over the static cache (CUDA graphs on a GPU), on randomly
initialised Qwen2 models (no download).

For each model: a prefill of ``--rows`` rows of ``--prompt`` tokens (one prompt a group of
8, prefilled once), then ``--new`` one-token steps, greedy (argmax, so both sides feed the
same tokens); eager and compiled take turns, median of ``--reps`` runs after a warm-up.
Printed: tokens/s each way, the ratio, the first compile's seconds, the number of graphs
compiled (1 per shape: more means a recompile) and the largest logit difference from the
eager step over all steps.

    python benchmarks/gpu/rollout_compile.py                 # on the GPU if there is one
    python benchmarks/gpu/rollout_compile.py --device cpu --models 3m 25m
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, Qwen2Config

from rltune.rollout.compiled import CompiledStep
from rltune.rollout.fastpath import LeanDecoder

MODELS = {
    "3m": dict(vocab_size=260, hidden_size=256, intermediate_size=1024, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2),
    "25m": dict(vocab_size=260, hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=4),
    # Qwen2-0.5B's shape
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def decode(model, ids, mask, new: int, compiled: CompiledStep | None,
           feed: list[torch.Tensor] | None = None) -> tuple[float, list[torch.Tensor]]:
    """Seconds of a prefill and ``new - 1`` steps, and the tokens fed. Each step feeds the
    argmax of the last logits, or, given ``feed``, those tokens (so that two runs whose
    logits differ by rounding see the same inputs; a near tie would otherwise send them
    down different continuations)."""
    sync(ids.device)
    start = time.perf_counter()
    decoder = LeanDecoder(model, max_new_tokens=new, compiled=compiled)
    logits = decoder.prefill(ids, mask, repeats=8)
    fed = []
    for t in range(new - 1):
        fed.append(logits.argmax(-1) if feed is None else feed[t])
        logits = decoder.step(fed[-1])
    sync(ids.device)
    return time.perf_counter() - start, fed


@torch.inference_mode()
def logit_diff(model, ids, mask, new: int, compiled: CompiledStep, feed: list[torch.Tensor]) -> float:
    """The largest difference between the eager and the compiled logits over all steps,
    both fed ``feed``."""
    decoders = [LeanDecoder(model, max_new_tokens=new, compiled=c) for c in (None, compiled)]
    worst = float((decoders[0].prefill(ids, mask, repeats=8) - decoders[1].prefill(ids, mask, repeats=8)).abs().max())
    for tokens in feed:
        eager = decoders[0].step(tokens).float()
        worst = max(worst, float((eager - decoders[1].step(tokens).float()).abs().max()))
    return worst


def measure(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    config = Qwen2Config(**MODELS[name], max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    ids = torch.randint(4, 250, (args.rows // 8, args.prompt), device=device)
    mask = torch.ones_like(ids)
    compiled = CompiledStep()
    graphs = counters["stats"]["unique_graphs"]
    first, _ = decode(model, ids, mask, args.new, compiled)
    compile_graphs = counters["stats"]["unique_graphs"] - graphs
    decode(model, ids, mask, args.new, None)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.reps):
        t_eager, fed = decode(model, ids, mask, args.new, None)
        t_comp, _ = decode(model, ids, mask, args.new, compiled, feed=fed)
        times["eager"].append(t_eager)
        times["compiled"].append(t_comp)
    diff = logit_diff(model, ids, mask, args.new, compiled, fed)
    tokens = args.rows * args.new
    rate = {k: tokens / statistics.median(v) for k, v in times.items()}
    print(f"{name:>5} {str(dtype).removeprefix('torch.'):>8} {device.type}: eager {rate['eager']:9.0f} tok/s, "
          f"compiled {rate['compiled']:9.0f} tok/s, x{rate['compiled'] / rate['eager']:.2f}; first compiled "
          f"decode {first:.1f} s, graphs {compile_graphs} (+{counters['stats']['unique_graphs'] - graphs - compile_graphs} "
          f"after), max |logit diff| {diff:.2e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=["25m", "0.5b"], choices=sorted(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"rows {args.rows}, prompt {args.prompt}, new tokens {args.new}", flush=True)
    for name in args.models:
        for dtype in args.dtypes:
            measure(name, args, device, getattr(torch, dtype))


if __name__ == "__main__":
    main()
