"""The driver's side of a tensor-parallel engine: ranks 1..N-1 as local processes.

`RankProcesses.launch(config)` starts one plain process per rank (`python -m
splitserve.engine.parallel.rank_process`, so a user's script is never re-imported), each with its
end of a socket pair; hands each its setup; joins the process groups with them; and from then on
forwards the engine's calls (`send`). `close()` tells them to stop and waits for them (killing
one that does not stop); dropping the object or leaving the interpreter does the same. A rank
whose driver dies sees its socket close and ends too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.parallel import rendezvous
from splitserve.engine.parallel.commands import Command, Shutdown
from splitserve.engine.parallel.group import TensorParallel
from splitserve.engine.parallel.handshake import RankFailed, RankJoining, RankReady, RankSetup
from splitserve.engine_config import EngineConfig

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # how long a rank told to stop may take before it is killed
_POLL_S = 0.05


class RankGone(RuntimeError):
    """A rank's process ended while the driver still needed it; the engine must be started again."""


class RankProcesses:
    """Owns ranks 1..N-1 of one engine: their processes and the connections commands go through.

    `send` forwards a command to every rank in order (`send_to`: to one); it raises `RankGone`
    naming a rank whose process has ended. Commands are pickled whole (tensors by value: torch's
    multiprocessing pickler would pass their storage as file descriptors). Sends are serialized by
    a lock: the engine thread sends its calls, a state reader's thread the pieces it cuts for the
    ranks, each message whole and in the order taken. `receive` (the engine thread) reads what a
    rank sends back: its KDA shares of an exporting step.
    """

    def __init__(self, procs: list[subprocess.Popen[bytes]], conns: list[Connection]) -> None:
        self.procs = procs
        self.conns = conns
        self._send_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _end, procs, conns)

    @classmethod
    def launch(cls, config: EngineConfig) -> tuple[RankProcesses, TensorParallel]:
        """Start ranks 1..N-1 for `config` (rank 0 is this process) and join their group. A model
        the ranks cannot split is refused first (ValueError), before any process starts."""
        world = config.tensor_parallel_size
        model = KimiLinearModelConfig.from_pretrained(Path(config.model).expanduser())
        TensorParallel(size=world, expert_parallel=config.expert_parallel).check_model(model)
        store, address = rendezvous.host_store("127.0.0.1", world)
        ranks = cls([], [])
        try:
            for rank in range(1, world):
                ranks._start(RankSetup(rank_config(config, rank), rank, world, address))
            ranks._await_all(RankJoining, "join")  # alive and joining: the join below will not wait in vain
            device = torch.device(rank_config(config, 0).device)
            tp = rendezvous.join(address, 0, world, device, config.expert_parallel, store=store)
        except BaseException:
            ranks.close()
            raise
        return ranks, tp

    def _start(self, setup: RankSetup) -> None:
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.engine.parallel.rank_process", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        conn = Connection(ours.detach())
        self.procs.append(proc)
        self.conns.append(conn)
        conn.send(setup)

    def wait_ready(self) -> None:
        """Block until every rank has loaded its shard; raises naming a rank that failed."""
        self._await_all(RankReady, "load")

    def _await_all(self, kind: type, what: str) -> None:
        """Wait for a `kind` message from each rank; a `RankFailed` or a dead process raises."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(_POLL_S):
                if proc.poll() is not None:
                    raise RankGone(f"rank {rank} ended (exit code {proc.returncode}) before it could {what}")
            message = conn.recv()
            if isinstance(message, RankFailed):
                raise RuntimeError(f"rank {rank} failed to {what}:\n{message.error}")
            if not isinstance(message, kind):
                raise RuntimeError(f"rank {rank} answered {message!r}, expected {kind.__name__}")

    def failures(self) -> list[str]:
        """The errors ranks reported (after the driver's own start failed), waiting a little for them."""
        found = []
        deadline = time.monotonic() + 2.0
        for rank, conn in enumerate(self.conns, start=1):
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    message = conn.recv()
                    if isinstance(message, RankFailed):
                        found.append(f"rank {rank}: {message.error}")
            except (EOFError, OSError):
                continue
        return found

    def send(self, command: Command) -> None:
        """Forward `command` to every rank, in order."""
        data = pickle.dumps(command)
        with self._send_lock:
            for rank in range(1, len(self.conns) + 1):
                self._send(rank, data)

    def send_to(self, rank: int, command: Command) -> None:
        """Forward `command` to rank `rank` (1..N-1) only."""
        data = pickle.dumps(command)
        with self._send_lock:
            self._send(rank, data)

    def _send(self, rank: int, data: bytes) -> None:
        try:
            self.conns[rank - 1].send_bytes(data)
        except OSError as exc:
            raise self._gone(rank) from exc

    def receive(self, rank: int) -> Any:
        """The next thing rank `rank` sent back (blocks; `RankGone` if its process ended)."""
        try:
            return pickle.loads(self.conns[rank - 1].recv_bytes())
        except (EOFError, OSError) as exc:
            raise self._gone(rank) from exc

    def _gone(self, rank: int) -> RankGone:
        proc = self.procs[rank - 1]
        proc.poll()
        return RankGone(
            f"rank {rank} of this tensor-parallel engine is gone (exit code {proc.returncode}); "
            "start the engine again"
        )

    def ended(self) -> str | None:
        """Which rank's process has ended, in words, or None while all run (any thread)."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                return f"rank {rank} ended (exit code {proc.returncode})"
        return None

    def close(self) -> None:
        """Tell every rank to stop, wait for it (kill it after STOP_TIMEOUT_S); idempotent."""
        self._finalizer()


def _end(procs: list[subprocess.Popen[bytes]], conns: list[Connection]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):  # a rank already gone
            conn.send_bytes(pickle.dumps(Shutdown()))
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("rank process %d did not stop within %.0f s; killing it", proc.pid, STOP_TIMEOUT_S)
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """`config` as rank `rank` runs it: its own GPU (`cuda:rank`) and, on the CPU without
    `num_threads`, an equal share of this machine's cores (ranks share them)."""
    changes: dict[str, object] = {}
    if config.device.startswith("cuda"):
        if ":" in config.device:
            raise ValueError(
                f"device {config.device!r} names one GPU; a tensor-parallel engine takes device='cuda' "
                "and puts rank r on cuda:r"
            )
        changes["device"] = f"cuda:{rank}"
    elif config.num_threads is None:
        changes["num_threads"] = max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
    return config.replace(**changes)
