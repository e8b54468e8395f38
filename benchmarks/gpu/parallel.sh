#!/usr/bin/env bash
# Learner layouts on NVIDIA GPUs (NCCL): the equivalence checks, then learner MFU of a
# 1B-class model at each layout that fits this machine's GPUs. Never part of CI.
#   bash benchmarks/gpu/parallel.sh            # from the repository root, in the venv
# Both parts always run; the exit status is non-zero when either had a failing layout.
source "$(dirname "$0")/setup.sh"
status=0
echo "== equivalence on NCCL (two optimizer steps, fp32, TF32 off) =="
"$PY" benchmarks/gpu/parallel.py check || status=1
echo "== learner MFU, 1B-class Qwen2, bf16, seq 2048 =="
"$PY" benchmarks/gpu/parallel.py mfu --seq 2048 --rows 8 --steps 6 || status=1
exit "$status"
