#!/usr/bin/env bash
# Installs splitserve with the engine and the dev extras and runs the whole test suite
# (arguments go to pytest, e.g. `./scripts/test.sh tests/frontend -x`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SPLITSERVE_EXTRAS="[engine,dev]" . "$root/scripts/install.sh"
cd "$root"
python -m ruff check .            # lint first: it takes a second and names the line
python -m pytest -q "$@"
