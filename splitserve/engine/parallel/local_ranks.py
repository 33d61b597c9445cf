"""Ranks 1..N-1 as plain processes of this machine: the offline engine's launcher (no Ray).

Each rank is `python -m splitserve.engine.parallel.rank_process FD` (so a user's script is never
re-imported), FD its end of a socket pair to the driver. Every rank sees every GPU of the machine
and takes `cuda:rank`.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from splitserve.engine.parallel.ranks import RankHandle, rank_config
from splitserve.engine_config import EngineConfig

_RANK_MODULE = "splitserve.engine.parallel.rank_process"


class LocalProcess:
    """One rank's process (`proc`), which ends by itself once told to stop or once its driver is gone."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid = proc.pid

    def ended(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else f"ended (exit code {code})"

    def join(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def where(self) -> dict[str, Any]:
        return {}


class LocalProcesses:
    """Starts an engine's other ranks as processes beside it, joined over 127.0.0.1."""

    def rendezvous_host(self) -> str:
        return "127.0.0.1"

    def rank_config(self, config: EngineConfig, rank: int) -> EngineConfig:
        return rank_config(config, rank)

    def start(self, world_size: int) -> tuple[list[RankHandle], list[Connection]]:
        handles: list[RankHandle] = []
        conns: list[Connection] = []
        try:
            for _ in range(1, world_size):
                ours, theirs = socket.socketpair()
                with theirs:
                    command = [sys.executable, "-m", _RANK_MODULE, str(theirs.fileno())]
                    proc = subprocess.Popen(command, pass_fds=(theirs.fileno(),))
                handles.append(LocalProcess(proc))
                conns.append(Connection(ours.detach()))
        except BaseException:  # the ones started see their connection close and end
            for conn in conns:
                conn.close()
            for handle in handles:
                handle.kill()
            raise
        return handles, conns
