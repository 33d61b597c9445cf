#!/usr/bin/env bash
# Creates .venv (once) and installs splitserve into it. Sourced by run.sh and test.sh.
# Where no NVIDIA GPU is visible, the CPU build of torch goes in first, so the project's
# permissive `torch>=...` requirement is already satisfied and no multi-GB CUDA build is fetched.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPLITSERVE_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install --quiet "torch>=2.4"
  else
    pip install --quiet "torch==2.13.0"
  fi
fi
extras="${SPLITSERVE_EXTRAS:-}"
stamp="$venv/.splitserve-installed$extras"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  pip install --quiet -e "$root$extras"
  touch "$stamp"
fi
