#!/usr/bin/env bash
# The prepared device check (issue 10, item 4): on one CUDA GPU, in under 8 minutes,
#   1. installs what the GPU path needs into a venv (a CUDA torch, splitserve[engine,gpu,dev]:
#      triton, flash-linear-attention), reusing a machine's preinstalled CUDA torch when it has one;
#   2. runs the `gpu`-marked tests: the tiny model on CUDA gives the CPU's tokens, and each kernel
#      (paged MLA in Triton, fla's KDA, the fused MoE in Triton) matches its torch reference at
#      real shapes;
#   3. runs the decode CUDA graph test (graph replay == eager tokens, batch sizes 1..8);
#   4. prints experiments/gpu_throughput.py's tables: prefill and decode tokens/s of a ~1B random
#      kimi_linear in bf16 at batch 1/16/64, decode eager and with CUDA graphs, decode against the
#      memory-bandwidth bound, and each kernel against the torch path;
#   5. the same model's prefill of one long prompt (SPLITSERVE_GPU_LONG_PROMPT tokens, default 32768).
# Every stage runs even when an earlier one failed (a GPU lease is short: one run must show every
# problem); each has its own time limit, and the summary at the end names the stages that failed.
# The exit status is non-zero when any did.
# Environment: SPLITSERVE_GPU_STAGES (default "tests graphs throughput long": which stages run),
# SPLITSERVE_GPU_VENV (default ~/.cache/splitserve/venv-gpu), SPLITSERVE_GPU_NO_INSTALL=1
# (use the active python as is, e.g. on a machine with no network), TORCH_INDEX_URL (a CUDA torch index).
set -uo pipefail
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
        pip install --quiet "torch>=2.7" --index-url "$TORCH_INDEX_URL" || exit 1
      else
        pip install --quiet "torch>=2.7" || exit 1  # PyPI's Linux x86_64 wheels are CUDA builds
      fi
    fi
    echo "== installing splitserve[engine,gpu,dev] ($(elapsed))"
    pip install --quiet -e "$root[engine,gpu,dev]" || exit 1
  fi
fi

echo "== device ($(elapsed))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python - <<'PY' || exit 1
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

failed=()
stages=" ${SPLITSERVE_GPU_STAGES:-tests graphs throughput long} "
stage() {  # stage KEY NAME SECONDS CMD...: if KEY is asked for, run CMD under a limit, note a failure, go on
  local key="$1" name="$2" limit="$3"
  shift 3
  [[ "$stages" == *" $key "* ]] || return 0
  echo "== $name ($(elapsed))"
  timeout "$limit" "$@"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "!! $name failed (exit $rc$([ "$rc" -eq 124 ] && echo ", past its ${limit} s"))"
    failed+=("$name")
  fi
}
unset TRITON_INTERPRET
# a test still running after this many seconds prints every thread's stack (a hang says where it is)
pytest_gpu=(python -m pytest -q -m gpu -p no:cacheprovider -rs --durations=5 -o faulthandler_timeout=100)
stage tests "gpu-marked tests" 150 "${pytest_gpu[@]}" tests/engine --ignore=tests/engine/test_cuda_graph.py
stage graphs "decode CUDA graphs: replay gives the eager tokens at batch sizes 1..8" 150 \
  "${pytest_gpu[@]}" tests/engine/test_cuda_graph.py
model_dir="${TMPDIR:-/tmp}/splitserve-gpu-1b"  # built once, reused by the long-prompt stage
stage throughput "throughput" 220 python -m experiments.gpu_throughput --device cuda --model-dir "$model_dir"
long="${SPLITSERVE_GPU_LONG_PROMPT:-32768}"
stage long "one ${long}-token prompt" 90 python -m experiments.gpu_throughput --device cuda \
  --model-dir "$model_dir" --batch-sizes 1 --prompt-len "$long" --decode-tokens 8 --engine-only

if [ "${#failed[@]}" -ne 0 ]; then
  echo "== gpu_check FAILED in $(elapsed): ${failed[*]}"
  exit 1
fi
echo "== gpu_check done in $(elapsed)"
