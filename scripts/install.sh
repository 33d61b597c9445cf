#!/usr/bin/env bash
# Creates .venv (once) and installs splitserve into it. Sourced by run.sh and test.sh.
# SPLITSERVE_EXTRAS picks the install: "[engine]" by default (everything on one machine: the
# gateway, the store and the torch workers), "[engine,dev]" for the tests, and "" (set but empty)
# for the base install alone, which is what a GPU-less gateway or store node needs.
# Where torch is wanted and no NVIDIA GPU is visible, the CPU build of torch goes in first, so the
# engine's permissive `torch>=...` requirement is already satisfied and no multi-GB CUDA build is
# fetched.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPLITSERVE_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
extras="${SPLITSERVE_EXTRAS-[engine]}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
case "$extras" in
  *engine* | *dev*) wants_torch=1 ;;  # dev pulls in the engine: the tests run it
  *) wants_torch=0 ;;
esac
if [ "$wants_torch" = 1 ] && ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install --quiet "torch>=2.4"
  else
    pip install --quiet "torch==2.13.0"
  fi
fi
stamp="$venv/.splitserve-installed$extras"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  pip install --quiet -e "$root$extras"
  touch "$stamp"
fi
