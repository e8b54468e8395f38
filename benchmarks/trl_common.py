"""What the benchmarks against TRL share: the models, the interleaved runs, the report.

Rules both benchmarks keep (``grpo_vs_trl.py``, ``dpo_vs_trl.py``):

- The same untrained Qwen2 (``--model 3m`` or ``25m``), built locally with
  :func:`rltune.models.tiny.build_tiny` into one directory that every side loads; the
  same data (written once as jsonl by the parent), lengths, learning rate, fp32, no KL.
- Each side runs in a process of its own, started fresh; the sides are interleaved
  (TRL, rltune, plain TRL, TRL, rltune, plain TRL, ...) in one invocation so that noise
  from a shared machine hits every side alike, and each figure is the median over the
  repeats.
- Peak RSS is each child's own ``ru_maxrss`` as the kernel reports it to the parent
  (``os.wait4``), so a side cannot under-report it. The parent never loads torch (the
  model is built by a child of its own, :func:`prepare`): Linux carries a process's peak
  RSS over ``exec``, so a parent holding a model would floor every side's figure at its
  own memory.
- "plain TRL" is a separate script written as a TRL user writes one (no rltune import,
  the model given as a path, TRL's own ``train_samples_per_second``), so the reader can
  check that the TRL side of the harness runs at TRL's own speed.

A child prints one JSON object on its last stdout line; the parent adds ``peak_rss_mb``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, Any]] = {
    # ~3.0 M parameters (tied embeddings, vocabulary 260).
    "3m": dict(arch="qwen2", hidden_size=256, layers=3, heads=4, kv_heads=2),
    # ~23.7 M parameters.
    "25m": dict(arch="qwen2", hidden_size=512, layers=6, heads=8, kv_heads=4),
}
"""The benchmark models, as :func:`build_tiny` arguments (the same as ``grpo_profile.py``)."""


def digit_share(prompt: Any, completion: str, **_: Any) -> float:
    """The share of the completion's characters that are digits.

    An untrained byte-level model emits a digit about 1 time in 26 (10 of 260 ids), and
    every group has a spread of rewards, so the reward moves within a few dozen steps
    of a short run; exact-answer rewards stay at 0 for such a model and would measure
    nothing. The same function scores both sides (rltune loads it by path, TRL wraps it).
    """
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))


def build_model(directory: Path, size: str) -> Path:
    """Write the ``size`` model and tokenizer to ``directory`` (fp32 safetensors)."""
    from transformers import AutoModelForCausalLM

    from rltune.models.tiny import build_tiny, count_parameters

    build_tiny(directory, seed=0, **SIZES[size])
    params = count_parameters(AutoModelForCausalLM.from_pretrained(directory))
    print(f"model: Qwen2 {params / 1e6:.2f} M parameters ({size})", flush=True)
    return directory


def prepare(directory: Path, size: str, files: dict[str, tuple[str, str, int | None, Sequence[str]]]) -> Path:
    """Build the model and write the data files in a child process; the model directory.

    ``files`` maps a file name to ``(task, split, rows, fields)``: the first ``rows`` rows
    (all with None) of the built-in task's split, with only ``fields``. Done in a child so
    that the parent never loads torch: Linux carries a process's peak RSS over ``exec``,
    so every side started by a parent holding a model would report at least the parent's
    memory as its own peak."""
    spec = json.dumps({"directory": str(directory), "size": size, "files": files})
    done = subprocess.run([sys.executable, __file__, spec], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"building the model and data failed:\n{done.stderr[-4000:]}")
    print(done.stdout.strip(), flush=True)
    return directory / "model"


def _prepare(spec: dict[str, Any]) -> None:
    from rltune.data.tasks import TASKS

    directory = Path(spec["directory"])
    build_model(directory / "model", spec["size"])
    for name, (task, split, rows, fields) in spec["files"].items():
        chosen = TASKS[task](split)[:rows]
        write_jsonl(directory / name, [{k: r[k] for k in fields} for r in chosen])


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Write ``rows`` as jsonl (the one data file every side reads)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def shuffled_copy(path: Path, seed: int) -> Path:
    """A copy of the jsonl file ``path`` with its rows in the order of ``seed``.

    The rltune and trl sides read this copy in file order (rltune ``data.shuffle=false``,
    TRL's sequential sampler), so in a round both see the same rows in the same order:
    each library shuffling with its own generator made the learning figure depend on
    which rows came first (DPO: held-out accuracy 0.700 on both sides with the same order,
    0.700 against 0.725 with each side's own order, seed 0), a difference of data order,
    not of the algorithms."""
    import random

    rows = read_jsonl(path)
    random.Random(seed).shuffle(rows)
    return write_jsonl(path.with_name(f"{path.stem}.seed{seed}{path.suffix}"), rows)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def parse_sets(sets: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` overrides of a TRL config; a value is read as JSON when it parses
    (``true``, ``3``, ``1e-4``), as a string otherwise."""
    out: dict[str, Any] = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            sys.exit(f"--trl-set wants KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def child_env(threads: int | None) -> dict[str, str]:
    """The children's environment: the parent's, plus the same thread count for every
    side when ``--threads`` is given (torch's default otherwise, as a user runs it)."""
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def run_child(argv: list[str], env: dict[str, str], what: str) -> dict[str, Any]:
    """Run one side in a fresh process; its JSON result with ``peak_rss_mb`` added.

    Exits naming the side and showing the end of its error output when it fails."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        out = proc.stdout.read() if proc.stdout else ""
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            sys.exit(f"the {what} side failed (exit {proc.returncode}):\n{err.read()[-4000:]}")
    lines = out.strip().splitlines()
    if not lines:
        sys.exit(f"the {what} side printed no result")
    result = json.loads(lines[-1])
    result["peak_rss_mb"] = usage.ru_maxrss / 1024  # Linux reports KiB
    return result


def interleave(sides: Sequence[str], repeats: int,
               run: Callable[[str, int], dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Run every side once per round, in order, for ``repeats`` rounds; results by side.

    ``run(side, seed)`` gets the round's number as its training seed, the same for every
    side in a round and different between rounds, so the median of the learning figure
    is over seeds rather than one seed's luck."""
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for r in range(repeats):
        for side in sides:
            res = run(side, r)
            results[side].append(res)
            print(f"  round {r + 1}/{repeats} {side:>12}: {res['rate']:7.2f} {res['unit']}"
                  f"  quality {res['quality']:.3f}  peak RSS {res['peak_rss_mb']:6.0f} MB"
                  f"  threads {res.get('threads', '-')}",
                  flush=True)
    return results


SIDE_NOTES = {
    "rltune-async": "generation one step ahead of the learner, importance-corrected: "
                    "not TRL's synchronous algorithm",
    "rltune-compiled": "rollout.compile=true: the decode step compiled",
}
"""What an extra rltune row changes, printed beside its ratio."""
SAME_ALGORITHM = {"rltune-compiled"}
"""Extra rltune rows that run the same synchronous algorithm as ``rltune``, so that their
ratio counts towards the target like rltune's."""


def side_note(side: str) -> str:
    """The note printed beside an extra rltune row's ratio (``SIDE_NOTES``)."""
    if side not in SIDE_NOTES:
        raise KeyError(f"no note for the benchmark side {side!r}; add it to trl_common.SIDE_NOTES")
    return SIDE_NOTES[side]


def median_of(results: list[dict[str, Any]], key: str) -> float:
    """Median of ``key`` over a side's repeats."""
    return statistics.median(r[key] for r in results)


def report(results: dict[str, list[dict[str, Any]]], *, unit: str, quality: str,
           target: float) -> None:
    """Print each side's medians, the speed ratio, and whether rltune reaches ``target``
    times TRL's speed and at least TRL's learning (``quality``) for the same samples."""
    width = max(12, *(len(side) for side in results))
    print(f"\n{'side':>{width}} {unit:>14} {'(runs)':>22} {quality:>26} {'peak RSS MB':>12}")
    for side, res in results.items():
        runs = ", ".join(f"{r['rate']:.1f}" for r in res)
        print(f"{side:>{width}} {median_of(res, 'rate'):14.2f} {runs:>22} "
              f"{median_of(res, 'quality'):26.3f} {median_of(res, 'peak_rss_mb'):12.0f}")
    if "trl" in results and "trl-plain" in results and "trl_own_rate" in results["trl"][0]:
        own = median_of(results["trl"], "trl_own_rate")
        plain = median_of(results["trl-plain"], "trl_own_rate")
        print(f"\nTRL's own train_samples_per_second: harness {own:.2f}, plain script {plain:.2f}"
              f" (harness / plain = {own / plain:.2f})")
    judged = [s for s in results if s == "rltune" or s in SAME_ALGORITHM] if "trl" in results else []
    for side in judged:  # the same algorithm as TRL's: judged against the target
        ratio = median_of(results[side], "rate") / median_of(results["trl"], "rate")
        ours, theirs = median_of(results[side], "quality"), median_of(results["trl"], "quality")
        note = f" ({side_note(side)}; the same algorithm)" if side in SAME_ALGORITHM else ""
        print(f"{side} / TRL speed: {ratio:.2f}x (target {target:.1f}x: "
              f"{'met' if ratio >= target else 'NOT met'}){note}")
        equal, spread = learned_as_much([r["quality"] for r in results[side]],
                                        [r["quality"] for r in results["trl"]])
        print(f"{quality} after the same samples: {side} {ours:.3f}, TRL {theirs:.3f} (medians); {spread} "
              f"({side} at least equal: {'yes' if equal else 'NO'})")
    for side in (s for s in results if s.startswith("rltune-") and s not in judged and "trl" in results):
        ratio = median_of(results[side], "rate") / median_of(results["trl"], "rate")
        print(f"{side} / TRL speed: {ratio:.2f}x, {quality} {median_of(results[side], 'quality'):.3f} "
              f"({side_note(side)}; the synchronous, same-algorithm ratio is rltune's above)")


def learned_as_much(ours: Sequence[float], theirs: Sequence[float]) -> tuple[bool, str]:
    """Whether a side learned at least as much per sample as TRL over the rounds, and the
    figures that say so: the difference of the means with its standard error.

    In GRPO two runs of the same algorithm from the same seed still draw different samples
    (each library's random stream, docs/performance.md), so their learning figures differ
    by chance and comparing two medians says "NO" about half the time for equal learners.
    The rounds are therefore not pairs, and the verdict is that the side's mean is not
    below TRL's by more than two standard errors of the difference (unpaired, each side's
    sample variance over its rounds). Three rounds resolve only large differences; the
    80-seed study in docs/performance.md is the evidence for small ones. (In DPO the sides
    read the same pairs in the same order and their accuracies come out equal, which
    passes whatever the spread.) With one round each there is no spread: the side must be
    at or above TRL."""
    diff = statistics.fmean(ours) - statistics.fmean(theirs)
    if min(len(ours), len(theirs)) < 2:
        return diff >= 0, f"difference {diff:+.3f} (one round: no spread)"
    se = (statistics.variance(ours) / len(ours) + statistics.variance(theirs) / len(theirs)) ** 0.5
    return diff >= -2 * se, f"difference of the means {diff:+.3f}, standard error {se:.3f}"


def pair_accuracy(policy: Any, model_dir: Path, pairs: Sequence[dict[str, str]]) -> float:
    """Held-out preference accuracy of a trained ``policy``, judged the same way for every
    side: the share of ``pairs`` whose DPO implicit reward margin is positive,
    ``[log p(chosen) - log q(chosen)] - [log p(rejected) - log q(rejected)] > 0``, with
    ``q`` the untrained model in ``model_dir`` and each response scored as its tokens
    plus EOS right after the prompt's. One judge, not each library's own metric, so a
    difference in how the sides tokenise or count cannot favour either."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    margins = torch.zeros(len(pairs))
    for sign, field in ((1.0, "chosen"), (-1.0, "rejected")):
        seqs = [(tok(p["prompt"], add_special_tokens=False)["input_ids"],
                 tok(p[field], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
                for p in pairs]
        for model, weight in ((policy, 1.0), (reference, -1.0)):
            margins += sign * weight * _response_logps(model, seqs, tok.pad_token_id)
    return float((margins > 0).float().mean())


def _response_logps(model: Any, seqs: list[tuple[list[int], list[int]]], pad: int) -> Any:
    """Sum of the log-probs of each (prompt, response) pair's response tokens."""
    import torch

    width = max(len(p) + len(r) for p, r in seqs)
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    scored = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (p, r) in enumerate(seqs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, : len(p) + len(r)] = 1
        scored[i, len(p): len(p) + len(r)] = True
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (logps * scored[:, 1:]).sum(-1)


if __name__ == "__main__":
    _prepare(json.loads(sys.argv[1]))
