#!/usr/bin/env bash
# Run bench/gpu_smoke.py on a lent GPU machine (PyTorch + transformers, no DeepSpeed): first install
# DeepSpeed from the source distribution and the small wheels `make gpu-wheels` put in .gpu/ (carried
# with the call), with no index and no compiled ops (DS_BUILD_OPS=0: the learner needs none of them).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import deepspeed, pydantic" >/dev/null 2>&1; then
  if [ ! -d .gpu ]; then
    echo "deepspeed is missing and no .gpu/ folder was carried (run 'make gpu-wheels' here first)" >&2
  else
    # --no-deps: the image's numpy and torch import but pip may not see them as installed packages
    python -m pip install -q --no-index --no-deps --find-links .gpu setuptools wheel hjson msgpack ninja py-cpuinfo \
      psutil pydantic pydantic-core annotated-types typing-inspection typing-extensions einops nvidia-ml-py
    DS_BUILD_OPS=0 python -m pip install -q --no-index --no-deps --find-links .gpu --no-build-isolation deepspeed
  fi
fi
exec python bench/gpu_smoke.py "$@"
