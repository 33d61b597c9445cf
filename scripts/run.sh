#!/usr/bin/env bash
# Installs splitserve and starts the whole cluster on the embedded default (a tiny model created
# on first use): local Ray, 1 prefill + 1 decode worker, a state store and the gateway on 127.0.0.1:8000.
# Every argument goes to `splitserve up`, e.g. `./scripts/run.sh --config FILE` (a file holding only
# `gateway: {port: 9000}` moves the port; every other key keeps its default).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/install.sh"
exec splitserve up "$@"
