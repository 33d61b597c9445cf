"""`splitserve ...` run as a separate process, as a user types it, with this interpreter."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import pytest

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


class UpProcess:
    """Owns a `splitserve up` child in a new session (so its process group is its own) and its output.

    `prefix` goes before the command (e.g. `ip netns exec NS`), `args` after it; `env` replaces
    the environment (the runtime dir is added to it)."""

    def __init__(
        self,
        config: Path,
        runtime_dir: Path,
        name: str,
        *,
        prefix: Sequence[str] = (),
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        env = {**(os.environ if env is None else env), RUNTIME_DIR_ENV: str(runtime_dir)}
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "cli.main", "up", "--config", str(config), "--name", name, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.process.stdout, self.lines.put), daemon=True).start()
        threading.Thread(
            target=self._read, args=(self.process.stderr, self.stderr.append), daemon=True
        ).start()

    @staticmethod
    def _read(stream: IO[str], sink: Callable[[str], object]) -> None:
        for line in stream:
            sink(line)

    def wait_for_line(self, prefix: str, timeout_s: float) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                pytest.fail(
                    f"`up` printed no line starting {prefix!r} in {timeout_s} s; stderr: {self.stderr}"
                )
            if line.startswith(prefix):
                return line
            assert "DEGRADED" not in line and "lost" not in line, line

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to the process group (`up` drains and stops the deployment); SIGKILL after `timeout_s`."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout_s)
        self.kill_group()

    def kill_group(self) -> None:
        """SIGKILL whatever is left (test cleanup only)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
