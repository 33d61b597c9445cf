"""The driver's side of a tensor-parallel engine: ranks 1..N-1, however they were started.

`Ranks.launch(config, launcher)` has the launcher start one rank per place (plain local processes
by default, `local_ranks.LocalProcesses`; Ray actors in a worker's placement-group bundles,
`actor_ranks.RankActors`), each with a connection to this process; hands each its setup; joins
the process groups with them; and from then on forwards the engine's calls (`send`). `close()`
tells them to stop and waits for them (killing one that does not stop); dropping the object or
leaving the interpreter does the same. A rank whose driver dies sees its connection close and
ends too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

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
    """A rank ended while the driver still needed it; the engine must be started again."""


class RankHandle(Protocol):
    """One started rank past rank 0, as its launcher knows it (a process, a Ray actor)."""

    pid: int

    def ended(self) -> str | None:
        """How the rank ended, in words ("ended (exit code -9)"), or None while it runs (any thread)."""
        ...

    def join(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the rank to end on its own (after `Shutdown`); True if it did."""
        ...

    def kill(self) -> None:
        """End the rank now and give back what it holds; harmless once it has ended."""
        ...

    def where(self) -> dict[str, Any]:
        """Where the rank runs beyond its pid (a Ray actor's id, placement group, bundle, GPUs)."""
        ...


class RankLauncher(Protocol):
    """How an engine's ranks 1..N-1 start, and what each of them runs."""

    def rendezvous_host(self) -> str:
        """The address the other ranks reach rank 0's rendezvous store at."""
        ...

    def rank_config(self, config: EngineConfig, rank: int) -> EngineConfig:
        """`config` as rank `rank` (0 too) runs it: its device and, on the CPU, its threads."""
        ...

    def start(self, world_size: int) -> tuple[list[RankHandle], list[Connection]]:
        """Start ranks 1..world_size-1 and connect to each; ends what it started if one fails."""
        ...


class Ranks:
    """Owns ranks 1..N-1 of one engine: their handles and the connections commands go through.

    `send` forwards a command to every rank in order (`send_to`: to one); it raises `RankGone`
    naming a rank that has ended. Commands are pickled whole (tensors by value: torch's
    multiprocessing pickler would pass their storage as file descriptors). Sends are serialized by
    a lock: the engine thread sends its calls, a state reader's thread the pieces it cuts for the
    ranks, each message whole and in the order taken. `receive` (the engine thread) reads what a
    rank sends back: its KDA shares of an exporting step.
    """

    def __init__(self, handles: list[RankHandle], conns: list[Connection]) -> None:
        self.handles = handles
        self.conns = conns
        self._send_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _end, handles, conns)

    @classmethod
    def launch(cls, config: EngineConfig, launcher: RankLauncher) -> tuple[Ranks, TensorParallel]:
        """Start ranks 1..N-1 for `config` (rank 0 is this process) and join their group. A model
        the ranks cannot split is refused first (ValueError), before any rank starts."""
        world = config.tensor_parallel_size
        model = KimiLinearModelConfig.from_pretrained(Path(config.model).expanduser())
        TensorParallel(size=world, expert_parallel=config.expert_parallel).check_model(model)
        store, address = rendezvous.host_store(launcher.rendezvous_host(), world)
        handles, conns = launcher.start(world)
        ranks = cls(handles, conns)
        try:
            for rank, conn in enumerate(conns, start=1):
                conn.send(RankSetup(launcher.rank_config(config, rank), rank, world, address))
            ranks._await_all(RankJoining, "join")  # alive and joining: the join below will not wait in vain
            device = torch.device(launcher.rank_config(config, 0).device)
            tp = rendezvous.join(address, 0, world, device, config.expert_parallel, store=store)
        except BaseException:
            ranks.close()
            raise
        return ranks, tp

    def wait_ready(self) -> None:
        """Block until every rank has loaded its shard; raises naming a rank that failed."""
        self._await_all(RankReady, "load")

    def _await_all(self, kind: type, what: str) -> None:
        """Wait for a `kind` message from each rank; a `RankFailed` or an ended rank raises."""
        for rank, (handle, conn) in enumerate(zip(self.handles, self.conns), start=1):
            while not conn.poll(_POLL_S):
                if (ended := handle.ended()) is not None:
                    raise RankGone(f"rank {rank} {ended} before it could {what}")
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
        """The next thing rank `rank` sent back (blocks; `RankGone` if it ended)."""
        try:
            return pickle.loads(self.conns[rank - 1].recv_bytes())
        except (EOFError, OSError) as exc:
            raise self._gone(rank) from exc

    def _gone(self, rank: int) -> RankGone:
        how = self.handles[rank - 1].ended() or "closed its connection"
        return RankGone(f"rank {rank} of this tensor-parallel engine {how}; start the engine again")

    def ended(self) -> str | None:
        """Which rank has ended, in words, or None while all run (any thread)."""
        for rank, handle in enumerate(self.handles, start=1):
            if (how := handle.ended()) is not None:
                return f"rank {rank} {how}"
        return None

    def describe(self) -> list[dict[str, Any]]:
        """Each rank past rank 0: its pid and where it runs (`RankHandle.where`)."""
        return [{"rank": rank, "pid": h.pid, **h.where()} for rank, h in enumerate(self.handles, start=1)]

    def close(self) -> None:
        """Tell every rank to stop, wait for it (kill it after STOP_TIMEOUT_S); idempotent."""
        self._finalizer()


def _end(handles: list[RankHandle], conns: list[Connection]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):  # a rank already gone
            conn.send_bytes(pickle.dumps(Shutdown()))
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for handle in handles:
        if not handle.join(max(0.0, deadline - time.monotonic())):
            logger.warning("rank %d did not stop within %.0f s; killing it", handle.pid, STOP_TIMEOUT_S)
        with contextlib.suppress(Exception):  # at interpreter exit Ray may be gone already
            handle.kill()
    for conn in conns:
        conn.close()


def rank_config(config: EngineConfig, rank: int, own_device: bool = False) -> EngineConfig:
    """`config` as rank `rank` runs it: its own GPU and, on the CPU without `num_threads`, an equal
    share of this machine's cores (ranks share them). The GPU is `cuda:rank` where every rank sees
    all of the node's GPUs (local processes), `cuda:0` where each sees only its own (`own_device`:
    a Ray actor, whose CUDA_VISIBLE_DEVICES Ray sets to the GPU of its bundle)."""
    changes: dict[str, object] = {}
    if config.device.startswith("cuda"):
        if ":" in config.device:
            raise ValueError(
                f"device {config.device!r} names one GPU; a tensor-parallel engine takes device='cuda' "
                "and puts each rank on its own GPU"
            )
        changes["device"] = "cuda:0" if own_device else f"cuda:{rank}"
    elif config.num_threads is None:
        changes["num_threads"] = max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
    return config.replace(**changes)
