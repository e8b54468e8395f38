"""Time of the lean decoder's one-token step, variants alternated in one process.

Runs the GRPO benchmark's shapes (``--size 3m`` / ``25m``, the models of
``grpo_vs_trl.py``; one 6-token prompt, a group of 8 rows, 32 new tokens, greedy) on one
torch thread and reports CPU time of that thread (``time.thread_time``); with
``--threads N`` (N > 1) it runs N threads and reports wall-clock time, which only a
quiet machine makes meaningful (the other threads' work is not the main thread's CPU
time). The variants take turns generation by generation in one process, so that a
shared machine's load, which moves CPU time too (another process on the sibling core, a
thrashed cache), hits each alike; separate runs of each variant disagreed by up to 40 %
under load.

Variants: ``plain`` (``LeanDecoder(pack=False)``: on a CPU one ``F.linear`` per projection),
``packed fewrows`` and ``packed onednn`` (q/k/v and gate/up fused, on weights packed for
the few-row kernel of ``rltune/rollout/fewrows.cpp``, the CPU float32 default, or for
oneDNN's product), with ``--compiled`` ``compiled fewrows`` and ``compiled onednn`` (the
same packed weights, each step one call of ``rollout.compile``'s compiled step over a
static cache; its compile happens in the warm-up), and with
``--baseline FILE`` the ``LeanDecoder`` of another tree's ``fastpath.py``::

    git archive OLD rltune/rollout/fastpath.py | tar -x -C /tmp/old
    python benchmarks/decode_step.py --size 3m --baseline /tmp/old/rltune/rollout/fastpath.py

Per variant, medians over ``--repeats`` generations: ``prefill`` (building the decoder
and its prefill, where the weights are fused and packed), ``step`` (one of the 31
one-token steps) and ``per token`` (the whole generation over its 32 tokens).
``--profile`` prints torch.profiler's operator table of the default variant instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_common as common  # noqa: E402

ROWS = 8
NEW_TOKENS = 32


CLOCK = [time.thread_time]
"""The clock: this thread's CPU time, or wall time with ``--threads`` above 1."""


def one_generation(make: Callable[[], object], ids: torch.Tensor) -> tuple[float, float, float]:
    """(prefill s, s per step, s per token overall) of one greedy generation."""
    clock = CLOCK[0]
    start = clock()
    decoder = make()
    tokens = decoder.prefill(ids, torch.ones_like(ids), repeats=ROWS).argmax(-1)
    mid = clock()
    for _ in range(NEW_TOKENS - 1):
        tokens = decoder.step(tokens).argmax(-1)
    end = clock()
    return mid - start, (end - mid) / (NEW_TOKENS - 1), (end - start) / NEW_TOKENS


def baseline_decoder(path: Path) -> type:
    """``LeanDecoder`` of the ``fastpath.py`` at ``path``, loaded as a module of its own."""
    spec = importlib.util.spec_from_file_location("baseline_fastpath", path)
    if spec is None or spec.loader is None:
        sys.exit(f"--baseline {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module.LeanDecoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(common.SIZES), default="3m")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--baseline", type=Path, help="another tree's rltune/rollout/fastpath.py")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compiled", action="store_true", help="also time rollout.compile's step")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; above 1 the figures are wall-clock time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.threads > 1:
        CLOCK[0] = time.perf_counter
    from transformers import AutoModelForCausalLM

    from rltune.models.tiny import build_tiny
    from rltune.rollout.fastpath import KERNELS, LeanDecoder, can_pack, packed_kernel

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny(Path(tmp), **common.SIZES[args.size])
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    ids = torch.tensor([[ord(c) for c in "20+16="]])  # the byte tokenizer's ids
    variants: dict[str, Callable[[], object]] = {}
    if args.baseline:
        old = baseline_decoder(args.baseline)
        variants["baseline"] = lambda: old(model, max_new_tokens=NEW_TOKENS)
    variants["plain"] = lambda: LeanDecoder(model, max_new_tokens=NEW_TOKENS, pack=False)
    kernels = []
    for kernel in KERNELS if can_pack(model.lm_head.weight) else ():
        try:
            packed_kernel(kernel)
        except ValueError as err:
            print(f"packed {kernel}: not run ({err})")
            continue
        kernels.append(kernel)
    for kernel in kernels:
        variants[f"packed {kernel}"] = partial(LeanDecoder, model, max_new_tokens=NEW_TOKENS, pack=True, kernel=kernel)
    if args.compiled:
        from rltune.rollout.compiled import CompiledStep

        for kernel in kernels or [None]:
            # one set of buffers and one graph for every generation
            variants[f"compiled {kernel or ''}".strip()] = partial(
                LeanDecoder, model, max_new_tokens=NEW_TOKENS, compiled=CompiledStep(), kernel=kernel)
    with torch.inference_mode():
        for _ in range(2):  # warm-up: allocator, oneDNN primitives
            for make in variants.values():
                one_generation(make, ids)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.repeats):
                    one_generation(lambda: LeanDecoder(model, max_new_tokens=NEW_TOKENS), ids)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
            return
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, make in variants.items():
                runs[name].append(one_generation(make, ids))
    clock = "CPU time of one thread" if args.threads == 1 else f"wall time, {args.threads} threads"
    print(f"{args.size}, {ROWS} rows, {NEW_TOKENS} tokens, {clock}, medians of {args.repeats}")
    for name, res in runs.items():
        prefill, step, token = (statistics.median(r[i] for r in res) for i in range(3))
        print(f"  {name:>13}: prefill {prefill * 1e3:6.2f} ms  step {step * 1e6:8.1f} us  "
              f"per token {token * 1e6:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
