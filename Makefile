# One-command set-up: every target that runs code depends on the venv stamp, so a fresh
# machine gets torch (CPU build, installed first so nothing pulls CUDA wheels), then the project.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
CONFIG  ?= configs/sentiment_tiny.yaml
ASSETS  ?= assets/sentiment_tiny
ARGS    ?=

.PHONY: setup test test-fast lint train assets bench bench-trl clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

assets: $(STAMP)
	$(BIN)/python -m cluster.demo_assets --out $(ASSETS)

train: $(STAMP)
	$(BIN)/python -m cluster.train $(CONFIG) $(ARGS)

bench: $(STAMP)
	$(BIN)/python bench/bench_iteration.py

# This project against TRL's PPOTrainer on the demo (installs trl into .venv-trl on first use).
bench-trl: $(STAMP)
	$(BIN)/python bench/compare_trl.py $(ARGS)

clean:
	rm -rf runs .pytest_cache .ruff_cache
