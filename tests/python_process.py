"""Run Python code in a fresh interpreter: what a module imports shows only in a new process."""

from __future__ import annotations

import subprocess
import sys


def run_python(code: str, timeout_s: float = 120.0) -> str:
    """Runs `code` with this interpreter; fails the test with its stderr unless it exits 0. Returns stdout."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stderr
    return result.stdout
