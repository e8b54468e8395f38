#!/usr/bin/env bash
# The local runtime on one NVIDIA GPU (runtime.device: auto / cuda): the device cases of
# tests/e2e/test_e2e_device.py (PPO with a reference and a critic, resume, DPO), which skip
# on a machine without CUDA, then the demo recipe through the CLI on the GPU. Never part of CI.
#   bash benchmarks/gpu/local_device.sh     # from anywhere, in the venv
source "$(dirname "$0")/setup.sh"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'"
"$PY" -m pytest -q -rs tests/e2e/test_e2e_device.py -k cuda
runs=$(mktemp -d)
"$PY" -m rltune.cli train recipes/arith-grpo.yaml model.path=builtin:tiny train.steps=30 data.eval=null \
    checkpoint.every=0 checkpoint.final=false log.dir="$runs" name=gpu-local runtime.device=cuda
"$PY" - "$runs/gpu-local/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
first, last = rows[:5], rows[-5:]
mean = lambda rs: sum(r["reward/mean"] for r in rs) / len(rs)
print(f"reward: first 5 steps {mean(first):.3f}, last 5 steps {mean(last):.3f}")
PYEOF
