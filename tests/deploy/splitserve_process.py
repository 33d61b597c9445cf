"""`splitserve ...` run as a separate process, as a user types it, with this interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

from deploy.local_deployments import RUNTIME_DIR_ENV


def run_splitserve(
    *args: str, runtime_dir: str | None = None, env: dict[str, str] | None = None, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run `splitserve ARGS` to its end; it sees the deployments recorded in `runtime_dir` (default:
    `$SPLITSERVE_RUNTIME_DIR` of this process). `env` replaces the environment (then `runtime_dir`
    is added to it). A command still running after `timeout_s` fails the test."""
    child_env = dict(os.environ if env is None else env)
    if runtime_dir is not None:
        child_env[RUNTIME_DIR_ENV] = runtime_dir
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=child_env,
    )
