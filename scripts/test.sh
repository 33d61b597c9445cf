#!/usr/bin/env bash
# Installs splitserve with the engine and the dev extras and runs the whole test suite
# (arguments go to pytest, e.g. `./scripts/test.sh tests/frontend -x`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SPLITSERVE_EXTRAS="[engine,dev]" . "$root/scripts/install.sh"
cd "$root"
# The mooncake transport's tests need its wheel, which imports only where libibverbs is; elsewhere
# they skip, naming what is missing. The non-CUDA build (the CUDA one needs libcudart.so.12),
# unless a build that imports is already there.
if ldconfig -p 2>/dev/null | grep -q libibverbs && ! python -c "import mooncake.engine" 2>/dev/null; then
  pip install --quiet -e "$root[mooncake-cpu]"
fi
python -m ruff check .            # lint first: it takes a second and names the line
python -m pytest -q "$@"
