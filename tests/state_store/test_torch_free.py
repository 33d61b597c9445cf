"""The store, its gRPC layer, its actor, the shared state vocabulary and splitserve.rpc load without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_state_store_and_rpc_modules_import_without_torch() -> None:
    modules = [
        "state_store",
        "state_store.server",
        "state_store.actor",
        "splitserve.state",
        "splitserve.state.client",
        "splitserve.rpc",
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, f'torch was imported: {loaded[:3]}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)
