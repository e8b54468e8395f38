#!/usr/bin/env bash
# The learner's precisions on one NVIDIA GPU: bf16 / fp16 / fp8 step time, peak memory and
# the engine-learner log-prob mismatch of a 1B-class Qwen2 (benchmarks/gpu/precision.py),
# then bf16 and fp8 again with train.compile (float8 pays once its casts are compiled).
# fp8 needs torchao (pip install 'rltune[fp8]') and compute capability 8.9+. Never part of CI.
#   bash benchmarks/gpu/precision.sh [results.json]     # from anywhere, in the venv
out=${1:+$(realpath -m -- "$1")}  # before setup.sh moves to the repository root
source "$(dirname "$0")/setup.sh"
"$PY" -c "import torchao; print('torchao', torchao.__version__)" || echo "torchao missing: fp8 will be refused"
"$PY" benchmarks/gpu/precision.py --precisions bf16 fp16 fp8 bf16+compile fp8+compile --rows 8 --seq 1024 --steps 5 \
    --gen-rows 16 --gen-tokens 64 ${out:+--out "$out"}
