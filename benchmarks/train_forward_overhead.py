"""Where the training forward and backward of a tiny model spend their CPU time.

The log-prob forward the learner runs (:func:`rltune.models.logprobs.completion_logprobs`,
with entropy, as ``rltune.learner.objectives.logprob_forward`` calls it) and its backward,
on the benchmark models of ``trl_common`` (``3m``, ``25m``, fp32) and two batch shapes:

- ``dpo``: what ``dpo_vs_trl.py``'s learner gets, 16 ``builtin:arith_prefs`` pairs as
  ``collate_pairs`` lays them out (chosen and rejected rows of a prompt adjacent, so the
  shared-prompt forward applies), prompts left padded, answers + EOS right padded;
- ``grpo``: what ``grpo_vs_trl.py``'s learner gets, one 6-token prompt and a group of 8
  completions of 32 tokens.

``profile`` splits the self CPU time (``torch.profiler``, one thread) of forward+backward
into the matrix products (mm/addmm/bmm/linear kernels and SDPA's) and everything else,
and counts the ATen ops one forward dispatches (top-level ones: those not called by
another ATen op); the profiler's self time is wall time inside each op, so on a busy
machine its split is a guide, not a measurement. ``time`` compares implementations of
the forward (``hf``: the one above on the transformers forward, as before
:mod:`rltune.models.lean_forward`; ``lean``: that module's, which it runs now where it
applies) by process CPU time of forward+backward per step (``hf-nograd``,
``lean-nograd``: the forward alone without grad, as the reference pass runs it),
interleaved round by round, medians over ``--repeats``.

    python benchmarks/train_forward_overhead.py profile --model 3m
    python benchmarks/train_forward_overhead.py time --model 25m --repeats 7
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_common as common  # noqa: E402

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "mkldnn", "aten::_linear")
"""Self-CPU time of these ops (prefix match) counts as arithmetic; the rest is overhead:
elementwise ops, views, copies, autograd bookkeeping, Python (not seen by the profiler)."""

Batch = tuple[torch.Tensor, torch.Tensor, int]


def load_model(size: str, directory: Path) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rltune.models.tiny import build_tiny

    build_tiny(directory, seed=0, **common.SIZES[size])
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.train(), AutoTokenizer.from_pretrained(directory)


def dpo_batch(tokenizer: object, pairs: int = 16) -> Batch:
    """``pairs`` arithmetic preference pairs, laid out as ``collate_pairs`` does."""
    from rltune.data.chat import encode_completion
    from rltune.data.collate import join
    from rltune.data.tasks import arith_prefs

    prompts, completions = [], []
    for row in arith_prefs("train")[:pairs]:
        ids = torch.tensor(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
        prompts += [ids, ids]
        completions += [torch.tensor(encode_completion(tokenizer, row[k])) for k in ("chosen", "rejected")]
    return join(prompts, completions, tokenizer.pad_token_id)


def grpo_batch(vocab: int, group: int = 8, prompt: int = 6, completion: int = 32) -> Batch:
    """One ``prompt``-token prompt and ``group`` completions of ``completion`` tokens."""
    from rltune.data.collate import join

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (prompt,), generator=g)
    return join([ids] * group, [torch.randint(3, vocab, (completion,), generator=g) for _ in range(group)], 0)


@contextlib.contextmanager
def transformers_path() -> Iterator[None]:
    """Within the block ``completion_logprobs`` runs the transformers forward (its path
    before :mod:`rltune.models.lean_forward`), for every model."""
    import rltune.models.logprobs as logprobs

    supports = logprobs.supports_lean_forward
    logprobs.supports_lean_forward = lambda model: False
    try:
        yield
    finally:
        logprobs.supports_lean_forward = supports


def _hf_forward(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    from rltune.models.logprobs import completion_logprobs

    with transformers_path():
        return completion_logprobs(model, batch[0], batch[1], batch[2], with_entropy=True).logprobs


def _lean_forward(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    from rltune.models.lean_forward import lean_completion_logprobs

    return lean_completion_logprobs(model, batch[0], batch[1], batch[2], with_entropy=True)[0]


FORWARDS: dict[str, Callable[[torch.nn.Module, Batch], torch.Tensor]] = {"hf": _hf_forward, "lean": _lean_forward}


def _train(impl: str) -> Callable[[torch.nn.Module, Batch], None]:
    """The forward with entropy and the backward of the log-probs' sum."""
    def run(model: torch.nn.Module, batch: Batch) -> None:
        FORWARDS[impl](model, batch).sum().backward()
    return run


def _no_grad(impl: str) -> Callable[[torch.nn.Module, Batch], None]:
    """The forward alone, without grad, as a reference or old-log-prob pass runs it."""
    def run(model: torch.nn.Module, batch: Batch) -> None:
        with torch.no_grad():
            FORWARDS[impl](model, batch)
    return run


IMPLS: dict[str, Callable[[torch.nn.Module, Batch], None]] = {
    "hf": _train("hf"), "lean": _train("lean"), "hf-nograd": _no_grad("hf"), "lean-nograd": _no_grad("lean")}


def split_profile(impl: str, model: torch.nn.Module, batch: Batch, steps: int) -> dict[str, float]:
    """Self-CPU ms per step of ``impl``: arithmetic, other ops, and ATen ops per forward."""
    from torch.profiler import ProfilerActivity, profile

    fn = IMPLS[impl]
    fn(model, batch)
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn(model, batch)
            model.zero_grad(set_to_none=True)
    totals: Counter[str] = Counter()
    for e in prof.events():
        if e.name.startswith("aten::") or e.name.startswith("mkldnn") or "Backward" in e.name:
            totals[e.name] += e.self_cpu_time_total
    arith = sum(v for k, v in totals.items() if k.startswith(MATMUL_OPS))
    other = sum(totals.values()) - arith
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as fwd:
        FORWARDS[impl](model, batch)
    events = fwd.events()
    top = sum(1 for e in events if e.name.startswith("aten::")
              and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    return {"arith_ms": arith / 1e3 / steps, "other_ms": other / 1e3 / steps, "aten_ops_fwd": top,
            "top_other": ", ".join(f"{k} {v / 1e3 / steps:.2f}" for k, v in totals.most_common(40)
                                   if not k.startswith(MATMUL_OPS))[:600]}


def step_cpu(fn: Callable[[torch.nn.Module, Batch], None], model: torch.nn.Module, batch: Batch,
             steps: int) -> float:
    """Process CPU ms per forward+backward, over ``steps`` steps after one warm-up."""
    fn(model, batch)
    model.zero_grad(set_to_none=True)
    start = time.process_time()
    for _ in range(steps):
        fn(model, batch)
        model.zero_grad(set_to_none=True)
    return (time.process_time() - start) * 1e3 / steps


def _print_split(head: str, s: dict[str, float]) -> None:
    share = s["other_ms"] / (s["arith_ms"] + s["other_ms"])
    print(f"{head}: fwd+bwd self-CPU matmul/sdpa {s['arith_ms']:.2f} ms, other {s['other_ms']:.2f} ms "
          f"({share:.0%} not matmul); {s['aten_ops_fwd']} top-level ATen ops per forward\n"
          f"  largest others (ms/step): {s['top_other']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("profile", "time"))
    parser.add_argument("--model", choices=sorted(common.SIZES), default="3m")
    parser.add_argument("--shapes", nargs="+", default=["dpo", "grpo"])
    parser.add_argument("--impls", nargs="+", choices=sorted(IMPLS), default=["hf", "lean"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as work:
        model, tokenizer = load_model(args.model, Path(work))
    batches = {"dpo": dpo_batch(tokenizer), "grpo": grpo_batch(model.config.vocab_size)}
    for shape in args.shapes:
        batch = batches[shape]
        head = f"{args.model} {shape} {tuple(batch[0].shape)} prompt {batch[2]}"
        if args.mode == "profile":
            for impl in args.impls:
                _print_split(f"{head} {impl}", split_profile(impl, model, batch, args.steps))
            continue
        times: dict[str, list[float]] = {impl: [] for impl in args.impls}
        for _ in range(args.repeats):
            for impl in args.impls:
                times[impl].append(step_cpu(IMPLS[impl], model, batch, args.steps))
        medians = {impl: statistics.median(v) for impl, v in times.items()}
        print(f"{head}: " + ", ".join(f"{impl} {m:.2f} ms (runs {', '.join(f'{t:.1f}' for t in times[impl])})"
                                      for impl, m in medians.items()), flush=True)
        ratios = [f"{a}/{b} {medians[a] / medians[b]:.2f}x" for a, b in (("hf", "lean"), ("hf-nograd", "lean-nograd"))
                  if a in medians and b in medians]
        print("  " + ", ".join(ratios), flush=True)


if __name__ == "__main__":
    main()
