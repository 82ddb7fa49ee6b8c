#!/usr/bin/env bash
# Run bench/gpu_e2e.py on a lent GPU machine (PyTorch + transformers, no Ray, no DeepSpeed): first
# install what `make gpu-wheels` put in .gpu/ (carried with the call) with no index: DeepSpeed from its
# source distribution (no compiled ops), the small wheels, and Ray trimmed by bench/trim_ray.py,
# unpacked into site-packages (its docstring says what was left out and why).
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_DEPS=$(grep -v '^#' bench/ray_deps.txt)  # what the image lacks for Ray and the runs
if ! python -c "import ray" >/dev/null 2>&1; then
  tarball=$(ls .gpu/ray-*-cp312-trimmed.tar.xz 2>/dev/null | head -1 || true)
  if [ -z "$tarball" ]; then
    echo "ray is missing and no .gpu/ray-*-cp312-trimmed.tar.xz was carried (run 'make gpu-wheels' here first)" >&2
    exit 2
  fi
  # --no-deps: the image's own packages import but pip may not see them as installed
  python -m pip install -q --no-index --no-deps --find-links .gpu $RAY_DEPS
  tar -xJf "$tarball" -C "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  python -c "import ray; print('ray', ray.__version__, 'from', ray.__file__)"
fi
# DeepSpeed and pydantic as bench/gpu_smoke.sh installs them (it then runs the smoke; here only the install)
if ! python -c "import deepspeed, pydantic" >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --find-links .gpu setuptools wheel hjson msgpack ninja py-cpuinfo \
    psutil pydantic pydantic-core annotated-types typing-inspection typing-extensions einops nvidia-ml-py
  DS_BUILD_OPS=0 python -m pip install -q --no-index --no-deps --find-links .gpu --no-build-isolation deepspeed
fi
exec python bench/gpu_e2e.py "$@"
