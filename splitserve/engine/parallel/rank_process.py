"""The process of one rank past rank 0: join the group, load this rank's shard, repeat the driver's calls.

Started by `local_ranks.LocalProcesses` as `python -m splitserve.engine.parallel.rank_process FD`, FD
being its end of a socket pair to the driver; a cluster's `actor_ranks.RankActor` runs `run_rank`
over its TCP connection to the driver. It receives a `RankSetup`, says `RankJoining`, joins the group,
loads its shard and answers `RankReady` (or `RankFailed` with the traceback), then applies each
command it receives to its own engine (`commands.py`) until `Shutdown` or until the driver's end
closes (the driver's process ended): a rank never outlives its driver.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import traceback
from multiprocessing.connection import Connection

import torch

from splitserve.engine.parallel import rendezvous
from splitserve.engine.parallel.commands import Command, Shutdown
from splitserve.engine.parallel.handshake import RankFailed, RankJoining, RankReady, RankSetup

logger = logging.getLogger(__name__)


def run_rank(conn: Connection) -> None:
    """Serve one rank over `conn` until told to stop or the driver is gone."""
    from splitserve.engine.llm_engine import LLMEngine

    setup: RankSetup = conn.recv()
    conn.send(RankJoining(setup.rank))
    try:
        config = setup.config
        tp = rendezvous.join(
            setup.store, setup.rank, setup.world_size, torch.device(config.device), config.expert_parallel
        )
        engine = LLMEngine(config, tp=tp)
    except BaseException:
        conn.send(RankFailed(setup.rank, traceback.format_exc()))
        raise
    conn.send(RankReady(setup.rank))
    while True:
        try:
            command: Command = pickle.loads(conn.recv_bytes())
        except EOFError:
            return  # the driver ended without a word: so does its rank
        if isinstance(command, Shutdown):
            return
        try:
            command.apply(engine)
        except Exception:
            if command.must_succeed:
                raise
            logger.debug("rank %d: %s failed as it did on the driver", setup.rank, command, exc_info=True)
        engine.take_prefix_events()  # nobody routes by a follower's events: drop them
        if command.answers():
            conn.send_bytes(pickle.dumps(True))
        exports = engine.follower_exports
        if exports is not None and exports.pieces:  # rank 0 exported in this step too: it waits for these
            conn.send_bytes(pickle.dumps(exports.take()))
        # rank 0 reads a step's messages in this order: exports (after the forward), ReplaySSM
        # shares (once the step's publishes are collected), retained prefixes (after the step)
        if engine.follower_replays:  # rank 0 collected the same publishes: it waits for these shares
            conn.send_bytes(pickle.dumps(engine.take_follower_replays()))
        retained = engine.follower_retained
        if retained is not None and retained.shares:
            conn.send_bytes(pickle.dumps(retained.take()))


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    with Connection(int(sys.argv[1])) as conn:
        run_rank(conn)
    # nothing is left to save, and the interpreter's teardown (a final collection over torch's
    # objects) took seconds per rank on 2 shared cores: leave at once
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
