"""One GRPO update on the same batch, rltune against TRL 1.16: do the two libraries learn
the same thing from the same samples?

``grpo_vs_trl.py`` compares the reward after 40 steps, but each side samples its own
completions, so it cannot tell an update that differs from sampling noise. Here both
sides get the SAME prompt and the SAME group of 8 completions, and the one update each
computes from them is compared:

1. Model, prompts and settings are ``grpo_vs_trl.py``'s (``trl_common.prepare``: 3 M
   Qwen2, ``builtin:arith/train``; group 8, 32 new tokens, temperature 1, lr 3e-4, fp32,
   no KL, token-mean loss, clip 0.2, group-std advantages with TRL's ``std + 1e-4``
   (``algo.adv_eps``), grad clip 1.0, AdamW).
2. rltune's run (``build_run`` with ``rltune_overrides``' config) samples the group with its
   own generator and scorer (``collector.collect``, as a training step does), reward
   ``trl_common.digit_share``; a group whose rewards are all equal is skipped.
3. rltune learns on those rollouts by its training path: ``source.experience``
   (``make_experience``) then ``loop.learn`` (``LocalLearner.step``).
4. TRL's GRPOTrainer (``run_trl``'s GRPOConfig, ``max_steps=1``) runs ``train()`` with
   ``_generate_single_turn`` replaced by one returning the same completion ids; TRL
   tokenises, decodes, scores, computes advantages, loss, backward, clip and AdamW step
   itself. A second TRL run gets rltune's advantages in place of its own.
5. Advantages, loss, gradient before and after the clip, grad norm and parameters after
   the step are tabled against fp32-derived tolerances (``TOL``); exit 1 beyond them.

``--sampling``: with the untrained model, 64 prompts x 8 from rltune's generator (the
run's collector) and from TRL's (``GRPOTrainer._generate``): mean reward, length, share
ending in EOS, and the first token's distribution (total variation distance, beside that
of two samples of the exact first-token distribution).

    .venv/bin/python benchmarks/grpo_same_batch.py                 # one check
    .venv/bin/python benchmarks/grpo_same_batch.py --checks 3      # three prompts / seeds
    .venv/bin/python benchmarks/grpo_same_batch.py --prompts-per-check 2 --sampling

TRL is the ``bench`` extra (``pip install 'rltune[bench]'``). Runs with one torch thread.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_common as common  # noqa: E402
from grpo_vs_trl import GROUP, NEW_TOKENS, rltune_overrides  # noqa: E402

LR = 3e-4

TOL = {
    # |A| <= sqrt(7) for 8 samples; each A is a mean, a std and a division in fp32
    # (relative error a few u = 6e-8), so ~1e-6 absolute. A different eps in the divisor
    # (rltune's default std + 1e-6 against TRL's std + 1e-4) is 1e-4 / std, far above this.
    "advantages": 1e-5,
    # the loss is a signed sum of ~250 token terms A_i * ratio that cancel, so its error is
    # measured against mean |A| over the tokens: a sum of n terms in fp32 errs by ~sqrt(n) u.
    "loss": 1e-5,
    # each gradient entry sums ~250 token contributions through 3 layers (inner sizes up to
    # 704): forward and backward in a different operation order (fused vs chunked head,
    # the shared prompt run once) err by ~sqrt(n) u ~ 1e-6 of the largest entries.
    "grad": 1e-5,
    "grad_norm": 1e-5,
    # Adam's first step moves each parameter by lr * g / (|g| + 1e-8), ~lr * sign(g); an
    # entry may flip only where |g| is within the gradient tolerance of 0.
    "param_moved": 1e-6,
}
"""Tolerances; the reason is beside each."""


def rltune_run(model_dir: Path, prompts: Path, work: Path, seed: int, prompts_per_step: int):
    """rltune's run with ``grpo_vs_trl.run_rltune``'s config (``rltune_overrides``)."""
    from rltune.config import load_config
    from rltune.runtime.local import build_run

    cfg = load_config(None, rltune_overrides(model_dir, prompts, work, seed=seed, steps=1, lr=LR,
                                             prompts_per_step=prompts_per_step))
    return build_run(cfg)


def sample_groups(run, k: int, tries: int = 50):
    """``k`` prompts whose sampled group has a spread of rewards, drawn in the run's
    order and sampled by the run's collector as a training step does."""
    from rltune.metrics.types import Aggregator
    from rltune.runtime.clock import StepClock

    collector = run.source.collector
    prompts, rollouts = [], []
    for _ in range(tries):
        drawn = collector.draw(1)
        _, group = collector.collect(drawn, Aggregator(), StepClock())
        if len({r.reward for r in group}) > 1:
            for r in group:
                r.group = len(prompts)
            prompts += drawn
            rollouts += group
        if len(prompts) == k:
            return prompts, rollouts
    sys.exit(f"no {k} groups with a spread of rewards in {tries} prompts")


def grads(named) -> dict:
    """Each parameter's gradient (zeros where none reached it)."""
    return {n: p.grad.detach().clone() if p.grad is not None else p.detach().new_zeros(p.shape) for n, p in named}


def params(named) -> dict:
    return {n: p.detach().clone() for n, p in named}


def settings(opt) -> str:
    """An optimizer's class and its step's settings, as its parameter groups hold them."""
    keys = ("lr", "betas", "eps", "weight_decay", "fused")
    return f"{type(opt).__name__} " + ", ".join(
        f"{k} {'/'.join(sorted({str(g[k]) for g in opt.param_groups}))}" for k in keys)


def rltune_update(run, rollouts) -> dict:
    """One step of rltune's training path on ``rollouts``: the experience, then
    ``loop.learn``; the clip is wrapped to see the gradient on both sides of it."""
    import torch

    from rltune.metrics import keys
    from rltune.metrics.types import Aggregator
    from rltune.runtime.clock import StepClock
    from rltune.runtime.loop import learn

    learner = run.roles.learner.learner
    model = learner.model
    out: dict = {"before": params(model.named_parameters())}
    clip = learner.parallelism.clip_grad_norm

    def seen_clip(ps, max_norm):
        out["grad_pre"] = grads(model.named_parameters())
        norm = clip(ps, max_norm)
        out["grad_post"] = grads(model.named_parameters())
        out["grad_norm"] = float(norm)
        return norm

    learner.parallelism.clip_grad_norm = seen_clip
    run.progress.step += 1  # as the loop does before its step
    batch = run.source.experience(rollouts, Aggregator(), StepClock())
    metrics = learn(run, batch)
    out["loss"] = metrics[keys.LOSS].value
    out["advantages"] = batch.advantages[:, 0].clone()
    out["rewards"] = torch.tensor([r.reward for r in rollouts])
    out["tokens"] = float(batch.loss_mask.sum())
    out["token_adv_abs"] = float((batch.advantages.abs() * batch.loss_mask).sum() / batch.loss_mask.sum())
    out["after"] = params(model.named_parameters())
    out["optimizer"] = settings(learner.optimizer)
    return out


def trl_trainer(model_dir: Path, texts: list[str], work: Path, seed: int):
    """TRL's GRPOTrainer with ``grpo_vs_trl.run_trl``'s GRPOConfig, one prompt per
    group, the dataset ``texts`` in order (``shuffle_dataset=False``)."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    def digit_share(completions, **_):
        return [common.digit_share(None, c) for c in completions]

    config = GRPOConfig(
        output_dir=str(work / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=GROUP * len(texts), num_generations=GROUP,
        max_completion_length=NEW_TOKENS, temperature=1.0, beta=0.0, learning_rate=LR,
        lr_scheduler_type="constant", max_steps=1, shuffle_dataset=False,
        report_to="none", save_strategy="no", logging_steps=1, seed=seed, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=digit_share, args=config,
                          train_dataset=Dataset.from_list([{"prompt": t} for t in texts]))
    trainer.remove_callback(PrinterCallback)  # its log lines would break up the table
    return trainer


def trl_update(trainer, rollouts, advantages=None) -> dict:
    """``trainer.train()`` for one step with TRL's generation replaced by the fixed
    completions of ``rollouts`` (each prompt row checked against the rollout's prompt
    ids); with ``advantages``, these replace TRL's own before the loss."""
    import torch

    model = trainer.model
    out: dict = {"before": params(model.named_parameters())}

    def fixed_generation(prompt_ids, *args, **kwargs):
        got = [list(map(int, ids)) for ids in prompt_ids]
        out["prompt_ids_equal"] = got == [r.prompt_ids.tolist() for r in rollouts]
        return [r.completion_ids.tolist() for r in rollouts], None

    score = trainer._generate_and_score_completions

    def seen_inputs(batch):
        made = score(batch)
        out["advantages"] = made["advantages"].detach().clone()  # TRL's own
        out["tokens"] = float(made["num_items_in_batch"])
        out["completion_mask_equal"] = made["completion_mask"].sum(1).tolist() == [
            len(r.completion_ids) for r in rollouts]
        if advantages is not None:  # the row then compares what the loss got
            made["advantages"] = advantages.to(made["advantages"].dtype).clone()
            out["advantages"] = made["advantages"].clone()
        return made

    loss_of = trainer.compute_loss

    def seen_loss(*args, **kwargs):
        loss = loss_of(*args, **kwargs)
        out["loss"] = float(loss.detach())
        return loss

    clip = trainer._clip_grad_norm

    def seen_clip(m):
        out["grad_pre"] = grads(model.named_parameters())
        norm = clip(m)
        out["grad_post"] = grads(model.named_parameters())
        out["grad_norm"] = float(norm)
        return norm

    trainer._generate_single_turn = fixed_generation
    trainer._generate_and_score_completions = seen_inputs
    trainer.compute_loss = seen_loss
    trainer._clip_grad_norm = seen_clip
    trainer.train()
    out["after"] = params(model.named_parameters())
    out["optimizer"] = settings(getattr(trainer.optimizer, "optimizer", trainer.optimizer))
    out["rewards"] = torch.tensor(list(trainer._logs["rewards"]["digit_share"])[-len(rollouts):])
    return out


def max_rel(a: dict, b: dict) -> tuple[float, float]:
    """``(max |a - b| / max |a|, max |a|)`` over every parameter's tensor."""
    diff = top = 0.0
    for name, x in a.items():
        diff = max(diff, float((x - b[name]).abs().max()))
        top = max(top, float(x.abs().max()))
    return diff / top if top else diff, top


def param_rows(a: dict, b: dict) -> list[tuple]:
    """The parameters after the step: the largest difference, how many entries differ by
    more than ``TOL["param_moved"]``, and how many of those have a gradient on rltune's
    side larger than the gradient tolerance (a flip there is not rounding)."""
    start, _ = max_rel(a["before"], b["before"])
    _, top = max_rel(a["grad_pre"], b["grad_pre"])
    floor = TOL["grad"] * top
    worst, moved, unexplained, total = 0.0, 0, 0, 0
    for name, x in a["after"].items():
        d = (x - b["after"][name]).abs()
        g = a["grad_pre"][name].abs()
        worst = max(worst, float(d.max()))
        big = d > TOL["param_moved"]
        moved += int(big.sum())
        unexplained += int((big & (g > floor)).sum())
        total += d.numel()
    return [
        ("params before the step, max |diff|", start, 0.0, start == 0.0),
        ("params after, max |diff| (2 lr = 6e-4: a flipped step)", worst, None, True),
        (f"params after, entries off by > {TOL['param_moved']:g} (of {total})", moved, None, True),
        (f"  of those with |g| > {TOL['grad']:g} max|g| (not rounding)", unexplained, 0, unexplained == 0),
    ]


def compare(a: dict, b: dict) -> list[tuple]:
    """Rows ``(quantity, value, tolerance, ok)`` of rltune's update ``a`` against TRL's ``b``."""
    adv = float((a["advantages"] - b["advantages"]).abs().max())
    loss = abs(a["loss"] - b["loss"]) / a["token_adv_abs"]
    pre, _ = max_rel(a["grad_pre"], b["grad_pre"])
    post, _ = max_rel(a["grad_post"], b["grad_post"])
    norm = abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]
    return [
        ("prompt ids (TRL's tokenisation = rltune's)", b["prompt_ids_equal"], True, b["prompt_ids_equal"]),
        ("completion tokens per row (TRL's mask = rltune's)", b["completion_mask_equal"], True,
         b["completion_mask_equal"]),
        ("loss tokens, rltune - TRL", a["tokens"] - b["tokens"], 0, a["tokens"] == b["tokens"]),
        ("rewards, max |diff|", float((a["rewards"] - b["rewards"]).abs().max()), 0.0,
         bool((a["rewards"] == b["rewards"]).all())),
        ("advantages, max |diff|", adv, TOL["advantages"], adv <= TOL["advantages"]),
        ("loss, |diff| / mean |A| over tokens", loss, TOL["loss"], loss <= TOL["loss"]),
        ("grad before clip, max |diff| / max |g|", pre, TOL["grad"], pre <= TOL["grad"]),
        ("grad after clip, max |diff| / max |g|", post, TOL["grad"], post <= TOL["grad"]),
        ("grad norm, relative diff", norm, TOL["grad_norm"], norm <= TOL["grad_norm"]),
        *param_rows(a, b),
    ]


def one_check(args, model_dir: Path, prompts_file: Path, seed: int) -> tuple[list, list, dict]:
    """Sample one batch with rltune, learn it on both sides; the rows of rltune against
    TRL as it is, and against TRL given rltune's advantages, and what was learned on."""
    with tempfile.TemporaryDirectory() as work:
        run = rltune_run(model_dir, prompts_file, Path(work), seed, args.prompts_per_check)
        prompts, rollouts = sample_groups(run, args.prompts_per_check)
        ours = rltune_update(run, rollouts)
        texts = [p.text for p in prompts]
        theirs = trl_update(trl_trainer(model_dir, texts, Path(work), seed), rollouts)
        given = trl_update(trl_trainer(model_dir, texts, Path(work), seed), rollouts, ours["advantages"])
    return compare(ours, theirs), compare(ours, given), (texts, rollouts, ours, theirs, given)


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e9):
        return f"{int(value)}"
    return f"{value:.3g}"


def print_check(index: int, seed: int, plain: list, given: list, batch: tuple) -> None:
    """The batch learned on, then the table: each quantity, its tolerance, and the
    difference against TRL as it is and against TRL given rltune's advantages."""
    texts, rollouts, *sides = batch
    print(f"\ncheck {index + 1} (seed {seed}): prompts {texts}")
    print(f"  rewards {[round(r.reward, 4) for r in rollouts]}")
    print(f"  lengths {[len(r.completion_ids) for r in rollouts]} "
          f"({sum(r.finish_reason == 'stop' for r in rollouts)} ended in EOS)")
    print(f"  advantages rltune {[round(a, 4) for a in sides[0]['advantages'].tolist()]}")
    print(f"  advantages TRL    {[round(a, 4) for a in sides[1]['advantages'].tolist()]}")
    print("  grad norm (rltune, TRL, TRL given rltune's A): {:.6g}, {:.6g}, {:.6g}; loss: {:.4g}, {:.4g}, {:.4g}"
          .format(*[side["grad_norm"] for side in sides], *[side["loss"] for side in sides]))
    print(f"  optimizers: rltune {sides[0]['optimizer']}; TRL {sides[1]['optimizer']}")
    print(f"\n  {'quantity':<58} {'tolerance':>9} {'vs TRL':>10} {'ok':>3} "
          f"{'vs TRL, rltune A':>17} {'ok':>3}")
    for (name, v1, tol, ok1), (_, v2, _, ok2) in zip(plain, given):
        print(f"  {name:<58} {fmt(tol):>9} {fmt(v1):>10} {fmt(ok1):>3} {fmt(v2):>17} {fmt(ok2):>3}")


def verdict(results: list[tuple[list, list]]) -> tuple[bool, str]:
    """Whether every check agrees within the tolerances, and the one line saying so."""
    plain_bad = [row[0] for plain, _ in results for row in plain if not row[3]]
    given_bad = [row[0] for _, given in results for row in given if not row[3]]
    if not plain_bad:
        return True, "SAME UPDATE: rltune and TRL agree within fp32 tolerances on every check"
    if given_bad:
        return False, f"DIFFER at '{plain_bad[0]}', and at '{given_bad[0]}' with rltune's advantages given to TRL"
    step = ("the same step after the clip (one group: a common factor, which the clip removes)"
            if not any("after" in name for name in plain_bad) else "a different step")
    return False, (f"DIFFER in the advantages only, {step}; "
                   "given rltune's advantages TRL computes the same loss, gradients and step")


def rltune_samples(run, prompts) -> list[dict]:
    """Each prompt's group from the run's collector, as a training step samples it."""
    from rltune.metrics.types import Aggregator
    from rltune.runtime.clock import StepClock

    out = []
    for i, prompt in enumerate(prompts):
        _, group = run.source.collector.collect([prompt], Aggregator(), StepClock())
        out += [{"prompt": i, "reward": r.reward, "length": len(r.completion_ids), "ids": r.completion_ids.tolist(),
                 "eos": float(r.finish_reason == "stop"), "first": int(r.completion_ids[0])} for r in group]
    return out


def trl_samples(trainer, prompts) -> list[dict]:
    """Each prompt's group from TRL's generation path (``_generate``, the prompt given
    ``num_generations`` times as TRL's sampler gives it), scored by ``digit_share``."""
    out = []
    for i, prompt in enumerate(prompts):
        _, ids, _, texts, *_ = trainer._generate([prompt.text] * GROUP)
        out += [{"prompt": i, "reward": common.digit_share(None, t), "length": len(c), "ids": list(c),
                 "eos": float(c[-1] in trainer.eos_token_ids), "first": int(c[0])} for c, t in zip(ids, texts)]
    return out


def first_token_probs(model, prompts):
    """``[prompts, vocab]`` the exact first-token distribution (temperature 1) after each prompt."""
    import torch

    model.eval()
    with torch.no_grad():
        rows = [model(input_ids=torch.tensor([p.input_ids])).logits[0, -1].float().softmax(-1) for p in prompts]
    return torch.stack(rows)


def tv(counts_a, counts_b) -> float:
    return 0.5 * float((counts_a / counts_a.sum() - counts_b / counts_b.sum()).abs().sum())


def first_token_rows(ours: list[dict], theirs: list[dict], probs, seed: int) -> list[str]:
    """Total variation distance of the first completion token's distribution: between
    the sides, and each side against the exact distribution, beside the same distance
    between independent samples of the exact one (the null; mean +- sd over 200 draws)."""
    import torch

    vocab = probs.shape[1]
    def counts(samples):
        return torch.bincount(torch.tensor([s["first"] for s in samples]), minlength=vocab).float()

    expected = probs.mean(0)
    gen = torch.Generator().manual_seed(seed)

    def draw():
        return torch.bincount(torch.multinomial(probs, GROUP, replacement=True, generator=gen).flatten(),
                              minlength=vocab).float()

    pair = [tv(draw(), draw()) for _ in range(200)]
    one = [tv(draw(), expected) for _ in range(200)]
    a, b = counts(ours), counts(theirs)
    null2, null1 = (f"null {statistics.mean(x):.3f} +- {statistics.stdev(x):.3f}" for x in (pair, one))
    return [f"  first token TV, rltune vs TRL:   {tv(a, b):.3f}   ({null2})",
            f"  first token TV, rltune vs exact: {tv(a, expected):.3f}   ({null1})",
            f"  first token TV, TRL vs exact:    {tv(b, expected):.3f}   ({null1})"]


def paired(ours: list[dict], theirs: list[dict], key: str) -> str:
    """Each side's mean of ``key`` +- its standard error over prompts, and the
    difference rltune - TRL +- its standard error (paired by prompt)."""
    n = 1 + max(s["prompt"] for s in ours)

    def per_prompt(samples):
        return [statistics.mean(s[key] for s in samples if s["prompt"] == i) for i in range(n)]

    a, b = per_prompt(ours), per_prompt(theirs)
    d = [x - y for x, y in zip(a, b)]

    def se(xs):
        return statistics.stdev(xs) / math.sqrt(len(xs))

    z = statistics.mean(d) / se(d) if se(d) else 0.0
    return (f"  {key:<8} rltune {statistics.mean(a):8.4f} +- {se(a):.4f}   TRL {statistics.mean(b):8.4f}"
            f" +- {se(b):.4f}   diff {statistics.mean(d):+.4f} +- {se(d):.4f} (z {z:+.2f})")


def sampling(args, model_dir: Path, prompts_file: Path) -> None:
    """``--sampling``: the two generators on the same prompts with the untrained model.
    TRL draws twice: with the run's seed and with another seed, whose draws are the
    independent sample the statistics compare. (HF's sampler calls ``torch.multinomial``;
    rltune's inverts the cumulative distribution with one uniform number a row,
    ``rltune.rollout.sampling``, so the same seed does not give the same tokens: the two
    draw from the same distribution in different ways.)"""
    with tempfile.TemporaryDirectory() as work:
        run = rltune_run(model_dir, prompts_file, Path(work), args.seed, 1)
        prompts = run.source.collector.draw(args.sampling_prompts)
        ours = rltune_samples(run, prompts)
        probs = first_token_probs(run.roles.learner.learner.model, prompts)
        same = trl_samples(trl_trainer(model_dir, [prompts[0].text], Path(work), args.seed), prompts)
        theirs = trl_samples(trl_trainer(model_dir, [prompts[0].text], Path(work), args.seed + 1000), prompts)
    alike = sum(a["ids"] == b["ids"] for a, b in zip(ours, same))
    print(f"\nsampling: {len(prompts)} prompts x {GROUP}, untrained model, temperature 1, up to "
          f"{NEW_TOKENS} new tokens (rltune: the run's collector; TRL: GRPOTrainer._generate)")
    print(f"  same seed ({args.seed}) on both sides: {alike} of {len(ours)} completions token for token alike")
    print(f"  rltune seed {args.seed} against TRL seed {args.seed + 1000} (independent draws):")
    print("\n".join([paired(ours, theirs, key) for key in ("reward", "length", "eos")]
                    + first_token_rows(ours, theirs, probs, args.seed)))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=1,
                        help="batches to check, each with its own seed (seed, seed + 1, ...) and prompts")
    parser.add_argument("--prompts-per-check", type=int, default=1,
                        help="prompts (groups of 8) in each batch; grpo_vs_trl.py learns on 1 a step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sampling", action="store_true",
                        help="also compare the two sides' sampling with the untrained model")
    parser.add_argument("--sampling-prompts", type=int, default=64)
    return parser.parse_args()


def main() -> None:
    args = parse()
    import warnings

    import torch
    from transformers.utils import logging

    torch.set_num_threads(1)
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # TRL's gradient_checkpointing name
    with tempfile.TemporaryDirectory() as tmp:
        files = {"prompts.jsonl": ("arith", "train", None, ("prompt", "answer"))}
        model_dir = common.prepare(Path(tmp), "3m", files)
        prompts_file = Path(tmp) / "prompts.jsonl"
        results = []
        for i in range(args.checks):
            seed = args.seed + i
            prompts = common.shuffled_copy(prompts_file, seed)  # each check its own prompts
            plain, given, batch = one_check(args, model_dir, prompts, seed)
            print_check(i, seed, plain, given, batch)
            results.append((plain, given))
        if args.sampling:
            sampling(args, model_dir, prompts_file)
    ok, line = verdict(results)
    print(f"\nverdict: {line}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
