"""Learner layouts on NVIDIA GPUs over NCCL: equivalence with one process, and MFU.

Run by ``benchmarks/gpu/parallel.sh`` (never part of CI). Two parts:

``check``: for each layout that fits the GPUs of this machine, the equivalence checks of
``tests/distributed/test_layouts_*.py`` on NCCL: the tiny models' loss, gradient norm and
parameters after two optimizer steps of a group (``tests/distributed/layout_workers.py``
``two_steps``, one process per GPU) against one process on the whole batch, in fp32 with
TF32 off. The tolerance is the CPU tests' (reduction order only) widened to 1e-4 for the
GPU's different kernels and summation order; a real mistake (the controls of the CPU
tests) is off by 1e-2 or more.

``mfu``: a 1B-class Qwen2 (hidden 2048, 16 layers, 16 heads, 8 KV heads, built from its
config, random weights: nothing is downloaded) trained with bf16 autocast on synthetic
SFT rows at each layout; reports tokens/s per GPU and MFU = model FLOPs per token x tokens/s
/ (GPUs x peak), with model FLOPs per token = 6 N + 12 L d T (PaLM appendix B) and the peak
of ``--peak-tflops`` (989: H100/H200 dense bf16); N leaves out the input embedding (a
lookup, not a product; the untied head is counted). Peak GiB is the largest rank's.

Each rank joins the group with rltune's default backend on GPUs (``cpu:gloo,cuda:nccl``:
the model's collectives on NCCL, the step metrics' CPU tensors on gloo). A layout that
fails is reported and the others still run.

    python benchmarks/gpu/parallel.py check
    python benchmarks/gpu/parallel.py mfu --seq 2048 --rows 8 --steps 6

``--cpu N`` runs either part on N CPU processes over gloo instead (the MFU part on a
small model, ``--size tiny``): a trial of this script on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))  # the layout harness

LAYOUTS = [
    ("tp=2", "builtin:tiny", dict(tp=2)),
    ("pp=2 gpipe", "builtin:tiny", dict(pp=2, pp_schedule="gpipe")),
    ("pp=2 1f1b", "builtin:tiny", dict(pp=2, pp_schedule="1f1b")),
    ("ep=2", "builtin:tiny-moe", dict(ep=2)),
    ("dp_shard=2", "builtin:tiny", dict(dp_shard=2)),
    ("dp_shard=2 x tp=2", "builtin:tiny", dict(dp_shard=2, tp=2)),
    ("dp_shard=2 x tp=2 sp", "builtin:tiny", dict(dp_shard=2, tp=2, sequence_parallel=True)),
    ("pp=2 x dp_shard=2", "builtin:tiny", dict(pp=2, dp_shard=2)),
    ("tp=2 x pp=2 x dp_shard=2", "builtin:tiny", dict(tp=2, pp=2, dp_shard=2)),
]
MFU_LAYOUTS = [dict(), dict(tp=2), dict(dp_shard=2), dict(pp=2), dict(tp=2, dp_shard=2),
               dict(tp=4, dp_shard=2), dict(pp=2, dp_shard=4), dict(dp_shard=8)]
TOLERANCE = 1e-4


def full_layout(layout: dict) -> dict:
    base = dict(dp_replicate=1, dp_shard=1, ep=1, tp=1, pp=1, pp_schedule="1f1b", sequence_parallel=False)
    return {**base, **layout}


def world_of(layout: dict) -> int:
    f = full_layout(layout)
    return f["dp_replicate"] * f["dp_shard"] * f["ep"] * f["tp"] * f["pp"]


def no_tf32() -> None:
    """fp32 products in fp32 (an NGC container may turn TF32 on by its environment)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def two_steps_fp32(model: str, layout: dict) -> dict:
    """One rank of ``layout_workers.two_steps`` with TF32 off in this rank's process."""
    import layout_workers

    no_tf32()
    return layout_workers.two_steps(model, layout)


def failed(error: BaseException) -> str:
    """The group's error whole on stderr (every rank's traceback); its last line for the table."""
    text = str(error).strip() or repr(error)
    print(text, file=sys.stderr)
    return text.splitlines()[-1]


def check(gpus: int) -> int:
    import layout_workers

    from rltune.learner.launch import spawn_learner_group

    no_tf32()
    failures = 0
    for name, model, layout in LAYOUTS:
        world = world_of(layout)
        if world > gpus:
            print(f"{name:28s} skipped: needs {world} GPUs, this machine has {gpus}")
            continue
        ref = layout_workers.reference(model)
        try:
            got = spawn_learner_group(world, two_steps_fp32, model, full_layout(layout))[0]
        except (RuntimeError, TimeoutError) as error:
            failures += 1
            print(f"{name:28s} FAIL  {failed(error)}")
            continue
        worst = max(
            max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(got["loss"], ref["loss"], strict=True)),
            max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(got["grad_norm"], ref["grad_norm"], strict=True)),
            max(float((got["params"][k].cpu() - v).abs().max()) for k, v in ref["params"].items()),
        )
        ok = worst <= TOLERANCE
        failures += not ok
        print(f"{name:28s} {'ok  ' if ok else 'FAIL'} worst difference {worst:.2e} (tolerance {TOLERANCE})")
    return 1 if failures else 0


SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=8, vocab_size=32000),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mfu_rank(layout: dict, seq: int, rows: int, steps: int, size: str = "1b") -> dict:
    """One rank of the MFU run: tokens/s of this rank's data shard over the timed steps."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rltune.algos import ALGORITHMS
    from rltune.config.schema import AlgoConfig, TrainConfig
    from rltune.data.records import TrainBatch
    from rltune.learner.distributed import shard_batch
    from rltune.learner.learner import LocalLearner
    from rltune.learner.objectives import build_objective
    from rltune.parallel.layout import Layout
    from rltune.parallel.strategy import MeshParallelism

    torch.manual_seed(0)
    config = Qwen2Config(**SIZES[size], max_position_embeddings=seq, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    parallelism = MeshParallelism(Layout(**full_layout(layout)))
    objective = build_objective(ALGORITHMS["sft"], AlgoConfig(name="sft"))
    cfg = TrainConfig(lr=1e-5, precision="bf16", micro_batch_tokens=seq * 2)
    learner = LocalLearner(model, objective, cfg, parallelism=parallelism)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (rows, seq), generator=g)
    batch = TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_len=1,
                       loss_mask=torch.ones(rows, seq - 1))
    shard = shard_batch(batch, parallelism.rank, parallelism.world)
    learner.step(shard)  # warm-up: allocations, NCCL communicators
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        learner.step(shard)
    sync()
    seconds = time.perf_counter() - start
    return {"params": float(params), "tokens_per_s": rows * seq * steps / seconds,
            "layers": float(config.num_hidden_layers), "hidden": float(config.hidden_size),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")}


def mfu(gpus: int, seq: int, rows: int, steps: int, peak_tflops: float, size: str) -> int:
    from rltune.learner.launch import spawn_learner_group

    print(f"{'layout':28s} {'GPUs':>4s} {'tokens/s':>10s} {'per GPU':>9s} {'MFU':>6s} {'peak GiB':>9s}")
    failures = 0
    for layout in MFU_LAYOUTS:
        world = world_of(layout)
        if world > gpus:
            continue
        name = " x ".join(f"{k}={v}" for k, v in layout.items()) or "one GPU"
        try:
            ranks = spawn_learner_group(world, mfu_rank, layout, seq, rows, steps, size)
        except (RuntimeError, TimeoutError) as error:
            print(f"{name:28s} {world:4d} FAIL  {failed(error)}")
            failures += 1
            continue
        out = ranks[0]
        flops_per_token = 6 * out["params"] + 12 * out["layers"] * out["hidden"] * seq
        utilisation = flops_per_token * out["tokens_per_s"] / (world * peak_tflops * 1e12)
        peak = max(r["peak_gib"] for r in ranks)
        print(f"{name:28s} {world:4d} {out['tokens_per_s']:10.0f} {out['tokens_per_s'] / world:9.0f} "
              f"{utilisation:6.1%} {peak:9.1f}")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["check", "mfu"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=8, help="global batch rows (split over the data ranks)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--cpu", type=int, default=0, metavar="N",
                        help="N CPU processes over gloo instead of the GPUs (a trial of this script)")
    args = parser.parse_args()
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch first asks: every rank on the CPU
        gpus = args.cpu
    elif not torch.cuda.is_available():
        print("no CUDA device: this script is for machines with NVIDIA GPUs (--cpu N for a trial on the CPU)")
        return 2
    else:
        gpus = torch.cuda.device_count()
    if args.part == "check":
        return check(gpus)
    return mfu(gpus, args.seq, args.rows, args.steps, args.peak_tflops, args.size)


if __name__ == "__main__":
    sys.exit(main())
