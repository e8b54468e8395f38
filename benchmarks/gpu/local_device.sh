#!/usr/bin/env bash
# The local runtime on one NVIDIA GPU (runtime.device: auto / cuda): the device cases of
# tests/e2e/test_e2e_device.py (PPO with a reference and a critic, resume, DPO), which skip
# on a machine without CUDA, then a GRPO run through the CLI on the GPU. Never part of CI.
#   bash benchmarks/gpu/local_device.sh     # from anywhere, in the venv
# The CLI run trains the built-in tiny model from its random weights, so it is rewarded by
# the share of digits in the completion (the e2e tests' reward, which such a model can
# learn in 30 steps), not by the exact sum (about 0 before any SFT warm-up). DEVICE=cpu
# runs that part on the CPU (a trial of this script on a machine without a GPU).
source "$(dirname "$0")/setup.sh"
device=${DEVICE:-cuda}
if [ "$device" = cuda ]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'"
  "$PY" -m pytest -q -rs tests/e2e/test_e2e_device.py -k cuda
fi
runs=$(mktemp -d)
cat > "$runs/digits.py" <<'PYEOF'
def digit_share(prompt, completion, **meta):
    """Share of the completion's characters that are digits."""
    return sum(ch.isdigit() for ch in completion) / len(completion) if completion else 0.0
PYEOF
"$PY" -m rltune.cli train recipes/arith-grpo.yaml model.path=builtin:tiny data.train=builtin:arith_small/train \
    data.eval=null "reward.0.fn=$runs/digits.py:digit_share" train.steps=30 train.prompts_per_step=8 \
    train.lr=1e-3 checkpoint.every=0 checkpoint.final=false log.dir="$runs" \
    log.console=false name=gpu-local runtime.device="$device"
"$PY" - "$runs/gpu-local/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
mean = lambda rs: sum(r["reward/mean"] for r in rs) / len(rs)
first, last = mean(rows[:5]), mean(rows[-5:])
print(f"reward (digit share): first 5 steps {first:.3f}, last 5 steps {last:.3f}")
sys.exit(0 if last > first else f"the reward did not rise ({first:.3f} -> {last:.3f})")
PYEOF
