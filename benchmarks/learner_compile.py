"""``train.compile`` on and off: the learner's step time and the compilation it costs.

Each side runs in its own fresh process (dynamo's caches are per process) with an empty
inductor cache directory (so the compile time is a first run's, not a cached one), the
sides interleaved (off, on, off, on, ...) so machine noise hits both. A process trains one
GRPO learner (no KL, fp32, AdamW) for ``--steps`` steps on random batches whose shapes vary
from step to step (rows, prompt and completion lengths), and reports:

- the first step's and the second shape's step time (compilation happens there: the first
  shape's graph, then the graph with symbolic sizes),
- the median time of the later steps (the steady state),
- how many graphs dynamo compiled over the whole run (recompiles would show here).

Usage::

    python benchmarks/learner_compile.py --model tiny --steps 12 --repeats 2
    python benchmarks/learner_compile.py --model 25m --steps 12 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = (12, 16)
PROMPTS = (8, 24)
COMPLETIONS = (24, 64)


def batches(steps: int, seed: int = 0) -> list:
    """``steps`` GRPO-like batches of varying shapes (the same for every side)."""
    import torch

    from rltune.data.collate import join
    from rltune.data.records import TrainBatch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = int(torch.randint(ROWS[0], ROWS[1] + 1, (1,), generator=g))
        prompts = [torch.randint(4, 260, (int(n),), generator=g) for n in torch.randint(*PROMPTS, (rows,), generator=g)]
        comps = [torch.randint(4, 260, (int(n),), generator=g) for n in torch.randint(*COMPLETIONS, (rows,), generator=g)]
        input_ids, attention_mask, prompt_len = join(prompts, comps, 0)
        loss_mask = attention_mask[:, prompt_len:].float()
        advantages = torch.randn(rows, generator=g)[:, None].expand_as(loss_mask)
        out.append(TrainBatch(input_ids=input_ids, attention_mask=attention_mask, prompt_len=prompt_len,
                              loss_mask=loss_mask, advantages=advantages))
    return out


def child(model_dir: str, compile_: bool, steps: int, threads: int) -> dict:
    """One side: ``steps`` learner steps; times per step and the graph count."""
    import torch

    from rltune.algos import ALGORITHMS
    from rltune.config.schema import AlgoConfig, TrainConfig
    from rltune.learner.compiled import compiled_graphs
    from rltune.learner.learner import LocalLearner
    from rltune.learner.objectives import build_objective
    from rltune.models.load import load_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = load_model(model_dir)
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo"))
    learner = LocalLearner(model, objective, TrainConfig(lr=1e-5, compile=compile_, micro_batch_tokens=8192))
    times = []
    for batch in batches(steps):
        start = time.perf_counter()
        learner.step(batch)
        times.append(time.perf_counter() - start)
    return {"times": times, "graphs": compiled_graphs(),
            "shapes": [list(b.input_ids.shape) for b in batches(steps)]}


def run_side(model_dir: str, compile_: bool, steps: int, threads: int) -> dict:
    """:func:`child` in a fresh process with an empty inductor cache."""
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads)}
        code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"from learner_compile import child; "
                f"print('RESULT', json.dumps(child({model_dir!r}, {compile_}, {steps}, {threads})))")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not line:
        raise RuntimeError(f"compile={compile_} side failed:\n{out.stderr[-4000:]}")
    return json.loads(line[0][len("RESULT "):])


def model_directory(size: str, work: Path) -> str:
    from rltune.models.load import resolve_model

    if size == "tiny":
        return resolve_model("builtin:tiny")
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_common import build_model

    return str(build_model(work / f"qwen2-{size}", size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "3m", "25m"), default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        model_dir = model_directory(args.model, Path(work))
        results: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeats):
            for compile_ in (False, True):
                res = run_side(model_dir, compile_, args.steps, args.threads)
                results[compile_].append(res)
                print(f"compile={compile_!s:5} first {res['times'][0]:7.2f}s  "
                      f"steps 2-3 {sum(res['times'][1:3]):7.2f}s  "
                      f"later median {statistics.median(res['times'][3:]):.3f}s  graphs {res['graphs']}", flush=True)
    print(f"shapes per step: {results[False][0]['shapes']}")
    steady = {c: statistics.median(statistics.median(r["times"][3:]) for r in results[c]) for c in results}
    overhead = statistics.median(sum(r["times"][:3]) for r in results[True]) - statistics.median(
        sum(r["times"][:3]) for r in results[False])
    print(f"model {args.model}, {args.threads} thread(s), {args.repeats} interleaved runs of {args.steps} steps")
    print(f"steady step: off {steady[False]:.3f}s, on {steady[True]:.3f}s "
          f"(on/off {steady[True] / steady[False]:.2f}); compilation ~{overhead:.1f}s per run "
          f"(first three steps, on minus off)")
    if steady[True] < steady[False]:
        print(f"break-even after ~{overhead / (steady[False] - steady[True]):.0f} steps")


if __name__ == "__main__":
    main()
