#!/usr/bin/env bash
# Installs splitserve and runs it on the embedded default (a tiny model created on first use).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/install.sh"
exec splitserve demo "$@"
