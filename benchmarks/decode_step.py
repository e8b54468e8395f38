"""CPU time of the lean decoder's one-token step, and of a whole generate call per token.

Runs the GRPO benchmark's shapes (``--size 3m`` / ``25m``, the models of
``grpo_vs_trl.py``; one 6-token prompt, a group of 8 rows, 32 new tokens) on one torch
thread and reports per-thread CPU time (``time.thread_time``), which other processes on
a shared machine disturb far less than wall-clock time. Medians over ``--repeats``:

- ``step``: one :meth:`LeanDecoder.step` (8 rows, one token each), averaged over the
  31 steps of a generation;
- ``prefill``: building the decoder and its prefill (the fused weights are built there);
- ``generate``: ``HFGenerator._decode`` (prefill, 32 sampling steps, bookkeeping), per
  token.

To compare two trees, run it with each first on ``PYTHONPATH``, interleaved::

    git archive OLD rltune | tar -x -C /tmp/old
    for i in 1 2; do PYTHONPATH=/tmp/old python benchmarks/decode_step.py --size 3m
                     python benchmarks/decode_step.py --size 3m; done

``--profile`` prints torch.profiler's operator table of the steps instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_common as common  # noqa: E402

ROWS = 8
NEW_TOKENS = 32


def one_generation(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """(prefill seconds, seconds per step) of one lean generation, CPU time of this thread."""
    from rltune.rollout.fastpath import LeanDecoder

    start = time.thread_time()
    decoder = LeanDecoder(model, max_new_tokens=NEW_TOKENS)
    tokens = decoder.prefill(ids, torch.ones_like(ids), repeats=ROWS).argmax(-1)
    mid = time.thread_time()
    for _ in range(NEW_TOKENS - 1):
        tokens = decoder.step(tokens).argmax(-1)
    return mid - start, (time.thread_time() - mid) / (NEW_TOKENS - 1)


def one_decode(generator: object, ids: torch.Tensor) -> float:
    """Seconds per token of one ``HFGenerator._decode`` (sampling at temperature 1)."""
    from rltune.data.records import SamplingParams

    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=ROWS)
    start = time.thread_time()
    generator._decode(ids, torch.ones_like(ids), params, repeats=ROWS)
    return (time.thread_time() - start) / NEW_TOKENS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(common.SIZES), default="3m")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rltune.models.tiny import build_tiny
    from rltune.rollout.hf import HFGenerator

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny(Path(tmp), **common.SIZES[args.size])
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        generator = HFGenerator(model, AutoTokenizer.from_pretrained(tmp), rng=torch.Generator().manual_seed(0))
    ids = torch.tensor([[ord(c) for c in "20+16="]])  # the byte tokenizer's ids
    with torch.inference_mode():
        for _ in range(2):  # warm-up: allocator, oneDNN primitives
            one_generation(model, ids)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.repeats):
                    one_generation(model, ids)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
            return
        runs = [one_generation(model, ids) for _ in range(args.repeats)]
        decodes = [one_decode(generator, ids) for _ in range(args.repeats)]
    print(f"{args.size}: step {statistics.median(r[1] for r in runs) * 1e6:8.1f} us, "
          f"prefill {statistics.median(r[0] for r in runs) * 1e3:6.2f} ms, "
          f"generate {statistics.median(decodes) * 1e6:8.1f} us/token "
          f"(CPU time of one thread, {ROWS} rows, median of {args.repeats})", flush=True)


if __name__ == "__main__":
    main()
