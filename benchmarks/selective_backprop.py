"""``algo.skip_zero_advantage`` on and off: the learner's step time against the share of
samples with zero advantage.

One process, one model, GRPO-like batches of ``--groups`` groups of ``--group-size``
samples; in each batch the first ``k`` groups have no reward spread (advantage zero on
every sample). For each share ``k / groups`` the two learners (skip off, skip on, the same
weights) step alternately, ``--repeats`` times each, so machine noise hits both; the
median step times and their ratio are printed, and the update's largest difference
between the two (it should be fp32 rounding only).

Usage::

    python benchmarks/selective_backprop.py --model tiny --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path


def make_batch(groups: int, group_size: int, zero_groups: int, seed: int):
    """A batch with prompts of 8..24 tokens and completions of 24..64, per-sample
    advantages, the first ``zero_groups`` groups' advantages zero."""
    import torch

    from rltune.data.collate import join
    from rltune.data.records import TrainBatch

    g = torch.Generator().manual_seed(seed)
    rows = groups * group_size
    prompts = [torch.randint(4, 260, (int(n),), generator=g) for n in torch.randint(8, 25, (groups,), generator=g)
               for _ in range(group_size)]
    comps = [torch.randint(4, 260, (int(n),), generator=g) for n in torch.randint(24, 65, (rows,), generator=g)]
    input_ids, attention_mask, prompt_len = join(prompts, comps, 0)
    loss_mask = attention_mask[:, prompt_len:].float()
    advantages = torch.randn(rows, generator=g)
    advantages[: zero_groups * group_size] = 0.0
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, prompt_len=prompt_len,
                      loss_mask=loss_mask, advantages=advantages[:, None].expand_as(loss_mask).contiguous())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "3m", "25m"), default="tiny")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from rltune.algos import ALGORITHMS
    from rltune.config.schema import AlgoConfig, TrainConfig
    from rltune.learner.learner import LocalLearner
    from rltune.learner.objectives import build_objective
    from rltune.metrics.types import scalars
    from rltune.models.load import load_model, resolve_model

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as work:
        if args.model == "tiny":
            model_dir = resolve_model("builtin:tiny")
        else:
            sys.path.insert(0, str(Path(__file__).parent))
            from trl_common import build_model

            model_dir = str(build_model(Path(work) / args.model, args.model))
        model = load_model(model_dir)
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo"))
    cfg = TrainConfig(lr=1e-5, micro_batch_tokens=4096)
    print(f"model {args.model}, {args.groups} groups of {args.group_size}, {args.threads} thread(s), "
          f"{args.repeats} alternating steps per side")
    print("zero-advantage share | skipped | step off (s) | step on (s) | on/off | max |w_on - w_off|")
    for zero_groups in range(0, args.groups + 1, max(1, args.groups // 4)):
        off = LocalLearner(copy.deepcopy(model), objective, cfg)
        on = LocalLearner(copy.deepcopy(model), objective, cfg, skip_zero_advantage=True)
        times: dict[bool, list[float]] = {False: [], True: []}
        skipped = 0.0
        for repeat in range(args.repeats):
            batch = make_batch(args.groups, args.group_size, zero_groups, seed=repeat)
            for skip, learner in ((False, off), (True, on)):
                start = time.perf_counter()
                metrics = scalars(learner.step(batch))
                times[skip].append(time.perf_counter() - start)
                if skip:
                    skipped = metrics["learn/skipped_frac"]
        diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(on.model.parameters(), off.model.parameters()))
        t_off, t_on = statistics.median(times[False]), statistics.median(times[True])
        print(f"{zero_groups / args.groups:20.2f} | {skipped:7.2f} | {t_off:12.3f} | {t_on:11.3f} | "
              f"{t_on / t_off:6.2f} | {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
