#!/usr/bin/env bash
# Creates .venv (once) and installs splitserve into it. Sourced by run.sh and test.sh.
# SPLITSERVE_EXTRAS picks the install: "[engine]" by default (everything on one machine: the
# gateway, the store and the torch workers), "[engine,dev]" for the tests, and "" (set but empty)
# for the base install alone, which is what a GPU-less gateway or store node needs.
# Where torch is wanted and not installed yet, a build for this machine goes in first, so the
# engine's permissive `torch>=...` requirement is already met and pip fetches nothing more for it:
# without a visible NVIDIA GPU, a torch wheel pip finds on this machine (its find-links), else the
# CPU build from PyTorch's CPU index (PyPI's Linux torch brings the multi-GB CUDA stack); with one, PyPI's build (CUDA 12). SPLITSERVE_TORCH_INDEX_URL picks
# another index (e.g. https://download.pytorch.org/whl/cu126 for a driver older than PyPI's
# build wants), SPLITSERVE_TORCH the requirement (default "torch>=2.4").
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
torch="${SPLITSERVE_TORCH:-torch>=2.4}"
if [ "$wants_torch" = 1 ] && ! python -c "import torch" >/dev/null 2>&1; then
  if [ -n "${SPLITSERVE_TORCH_INDEX_URL:-}" ]; then
    pip install --quiet --index-url "$SPLITSERVE_TORCH_INDEX_URL" "$torch"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install --quiet "$torch"
  else
    # A torch wheel already on this machine where pip's configured find-links has one (an
    # operator's own CPU build, an air-gapped mirror, CI's machine), else PyTorch's CPU index. The
    # local wheel is installed by its file, so its version is the one taken, not PyPI's newest.
    wheels="$(mktemp -d)"
    if pip download --quiet --no-index --no-deps --dest "$wheels" "$torch" >/dev/null 2>&1 \
      && ls "$wheels"/torch-*.whl >/dev/null 2>&1; then
      pip install --quiet "$wheels"/torch-*.whl
    else
      pip install --quiet --index-url https://download.pytorch.org/whl/cpu "$torch"
    fi
    rm -rf "$wheels"
  fi
fi
stamp="$venv/.splitserve-installed$extras"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  pip install --quiet -e "$root$extras"
  touch "$stamp"
fi
