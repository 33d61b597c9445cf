"""Run a test module's function under TRITON_INTERPRET=1 in a fresh interpreter and read its JSON result.

Triton decides between compiling and interpreting when it is imported, and another test in this
process may have imported it already, so kernel checks on the CPU run in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def interpreted(module: str, function: str, timeout_s: float = 600.0) -> Any:
    """`module.function()` (JSON-serialisable result) run with the Triton interpreter on."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"import json, {module} as m; print(json.dumps(m.{function}()))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
