"""`splitserve up` as a real process (the tiny model, real workers, its own local Ray), stopped the
way systemd and `kill -- -PGID` stop it: SIGTERM to its whole process group, Ray included.

Before, `up` then waited 60 s for the GCS that died with it and exited 1. The bound here is
the 30 s wait for the exit; nothing may be left running in its session afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.helpers import wait_until
from tests.deploy.splitserve_process import UpProcess, run_splitserve

STOP_TIMEOUT_S = 30
START_TIMEOUT_S = 600  # the first start may build the tiny model; this machine may be busy


def alive_in_session(session_id: int) -> list[str]:
    """`pid command` of every process of that session that is not a zombie."""
    alive = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = stat_path.read_text()
        except OSError:  # ended while we looked
            continue
        state, _ppid, _pgrp, session = stat[stat.rindex(")") + 2 :].split()[:4]
        if int(session) == session_id and state not in "ZX":
            alive.append(f"{stat_path.parent.name} {stat[stat.index('(') : stat.rindex(')') + 1]}")
    return alive


def tiny_config(path: Path, num_cpus: float, decode_replicas: int = 1) -> Path:
    """A config of the tiny model with small caches, each worker reserving `num_cpus`."""
    path.write_text(
        "gateway: {port: 0}\n"
        f"prefill: {{num_cpus: {num_cpus}, kv_cache_memory_bytes: 16MiB}}\n"
        f"decode: {{num_cpus: {num_cpus}, kv_cache_memory_bytes: 16MiB, replicas: {decode_replicas}}}\n"
        f"store: {{memory_bytes: 64MiB, disk: {{path: {path.parent / 'store'}, bytes: 64MiB}}}}\n"
    )
    return path


@contextlib.contextmanager
def up_process(config: Path, name: str) -> Iterator[tuple[UpProcess, Path]]:
    runtime_dir = Path(tempfile.mkdtemp(prefix="ss-"))  # short: Ray's socket paths live under it
    process = UpProcess(config, runtime_dir, name)
    try:
        yield process, runtime_dir
    finally:
        process.kill_group()
        shutil.rmtree(runtime_dir, ignore_errors=True)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[UpProcess, Path]]:
    with up_process(tiny_config(tmp_path / "tiny.yaml", num_cpus=0.5), "sigterm") as started:
        yield started


def test_sigterm_to_the_process_group_stops_up_and_leaves_nothing_running(up):
    process, runtime_dir = up
    process.wait_for_line("healthy:", START_TIMEOUT_S)
    record = json.loads((runtime_dir / "sigterm.json").read_text())
    assert record["pid"] == process.process.pid and record["namespace"] == "splitserve-sigterm"

    # The recorded deployment is the one `status` finds, with no --address.
    status = run_splitserve("status", runtime_dir=str(runtime_dir))
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith("model tiny-kimi-linear (disaggregated) - healthy")
    assert record["gateway_url"] in status.stdout

    running = alive_in_session(process.process.pid)
    assert any("raylet" in p for p in running) and any("gcs_server" in p for p in running), running

    os.killpg(process.process.pid, signal.SIGTERM)
    try:
        returncode = process.process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`up` still running {STOP_TIMEOUT_S} s after SIGTERM to its group")
    assert returncode == 0, "".join(process.stderr)
    wait_until(
        lambda: not alive_in_session(process.process.pid), timeout_s=STOP_TIMEOUT_S, what="no process left"
    )
    assert "stopped\n" in process.stderr
    assert not (runtime_dir / "sigterm.json").exists()


def test_the_quick_start_grows_with_apply_and_shrinks_with_resize(tmp_path):
    """As a new user would: `up`, then `apply` a config with a second decode replica, then `resize`
    back. The workers reserve 1 CPU each, as the default's do: a local Ray sized to the config
    exactly had no room for a third worker (a PlacementError)."""
    with up_process(tiny_config(tmp_path / "quick.yaml", num_cpus=1), "grow") as (process, runtime_dir):
        process.wait_for_line("healthy:", START_TIMEOUT_S)
        grown = tiny_config(tmp_path / "grown.yaml", num_cpus=1, decode_replicas=2)
        applied = run_splitserve("apply", "--config", str(grown), runtime_dir=str(runtime_dir), timeout_s=600)
        assert applied.returncode == 0, applied.stderr
        assert "  - decode: add 1 replica(s) (1 -> 2)" in applied.stdout
        assert "  done: decode: add 1 replica(s)" in applied.stdout
        assert applied.stdout.rstrip().splitlines()[-1].startswith("healthy: prefill 1/1, decode 2/2")
        wait_until(  # the controller logged the step, and Ray forwarded it to `up`'s terminal
            lambda: any(
                "splitserve.deploy: apply: decode: add 1 replica(s)" in line for line in process.stderr
            ),
            what="the controller's log line of the step in up's output",
        )

        resized = run_splitserve("resize", "decode", "1", runtime_dir=str(runtime_dir), timeout_s=600)
        assert resized.returncode == 0, resized.stderr
        assert resized.stdout.startswith("healthy: prefill 1/1, decode 1/1")
        os.killpg(process.process.pid, signal.SIGTERM)
        assert process.process.wait(timeout=STOP_TIMEOUT_S) == 0, "".join(process.stderr)
