#!/usr/bin/env bash
# The prepared device check (issue 10, item 4): on one CUDA GPU, in under 8 minutes,
#   1. installs what the GPU path needs into a venv (a CUDA torch, splitserve[engine,gpu,dev]:
#      triton, flash-linear-attention), reusing a machine's preinstalled CUDA torch when it has one;
#   2. runs the `gpu`-marked tests: the tiny model on CUDA gives the CPU's tokens, and each kernel
#      (paged MLA in Triton, fla's KDA) matches its torch reference at real shapes;
#   3. runs the decode CUDA graph test (graph replay == eager tokens, batch sizes 1..8);
#   4. prints experiments/gpu_throughput.py's tables: prefill and decode tokens/s of a ~1B random
#      kimi_linear in bf16 at batch 1/16/64, decode eager and with CUDA graphs, decode against the
#      memory-bandwidth bound, and each kernel against the torch path.
# Environment: SPLITSERVE_GPU_VENV (default ~/.cache/splitserve/venv-gpu), SPLITSERVE_GPU_NO_INSTALL=1
# (use the active python as is, e.g. on a machine with no network), TORCH_INDEX_URL (a CUDA torch index).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
start_s=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start_s )) s"; }

ready() {  # everything the check imports is there, with a CUDA torch
  python -c "import sys, torch, triton, fla, transformers, safetensors, pytest, pytest_timeout
sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1
}
if [ "${SPLITSERVE_GPU_NO_INSTALL:-0}" != 1 ]; then
  venv="${SPLITSERVE_GPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/splitserve/venv-gpu}"  # outside the tree
  if [ ! -x "$venv/bin/python" ]; then
    # system site packages: a CUDA torch already on the machine is used, not downloaded again
    "${PYTHON:-python3}" -m venv --system-site-packages "$venv"
  fi
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
  if ready; then
    echo "== the GPU path is installed already ($(elapsed))"
  else
    # needs PyPI; on a machine without a network, preinstall these and set SPLITSERVE_GPU_NO_INSTALL=1
    if ! python -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1; then
      echo "== installing a CUDA build of torch ($(elapsed))"
      if [ -n "${TORCH_INDEX_URL:-}" ]; then
        pip install --quiet "torch>=2.7" --index-url "$TORCH_INDEX_URL"
      else
        pip install --quiet "torch>=2.7"  # PyPI's Linux x86_64 wheels are CUDA builds
      fi
    fi
    echo "== installing splitserve[engine,gpu,dev] ($(elapsed))"
    pip install --quiet -e "$root[engine,gpu,dev]"
  fi
fi

echo "== device ($(elapsed))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python - <<'PY'
import importlib.util, sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device: this check needs one")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}")
for name in ("triton", "fla"):
    spec = importlib.util.find_spec(name)
    if spec is None:
        sys.exit(f"{name} is not importable: pip install -e '.[engine,gpu,dev]'")
    module = __import__(name)
    print(f"{name} {getattr(module, '__version__', '?')}")
PY

echo "== gpu-marked tests ($(elapsed))"
unset TRITON_INTERPRET
timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests/engine --ignore=tests/engine/test_cuda_graph.py

echo "== decode CUDA graphs: replay gives the eager tokens at batch sizes 1..8 ($(elapsed))"
timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_cuda_graph.py

echo "== throughput ($(elapsed))"
timeout 300 python -m experiments.gpu_throughput --device cuda

echo "== gpu_check done in $(elapsed)"
