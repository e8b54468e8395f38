# Sourced by the scripts beside it: run from the repository root with the venv's Python
# ($PYTHON, else python) and the checkout on the import path; print the GPUs and torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L || echo "nvidia-smi: not found, or it failed (no driver?)"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
