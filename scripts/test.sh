#!/usr/bin/env bash
# Installs splitserve with its dev extras and runs the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SPLITSERVE_EXTRAS="[dev]" . "$root/scripts/install.sh"
cd "$root"
python -m ruff check .            # lint first: it takes a second and names the line
python -m pytest -q "$@"
