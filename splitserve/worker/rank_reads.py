"""Each rank of a tensor-parallel decode reads a handed-off state from the store itself.

Rank 0's worker reads the key with its `StateReader`; the driver tells every other rank the same
key (`ReadTransferred`, made in the rank's process on its first such command: the engine itself
never imports gRPC), and each opens its own Get on the store (the arena, mapped in place, on
its node; bytes otherwise) and keeps what it owns: every MLA row (the latent is replicated) and
its heads of each KDA state (`ShardingSink` without forwarding: a piece is copied only where its
heads overlap the rank's). Nothing crosses rank 0. Admission on a rank waits for its read; rank 0
admits once every rank has said it did, so the worker releases the key only after all have read it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from splitserve.rpc_auth import set_cluster_token
from splitserve.state.client import StateStoreClient
from splitserve.state.streams import ChunkStream

if TYPE_CHECKING:  # only a rank's process (torch) runs this; a GPU-less node imports splitserve.worker
    from splitserve.engine.parallel.handoff import ShardingSink, StoreRead

READ_CLIENT_TIMEOUT_S = 10.0


class RankReads:
    """Owns one rank's reads in flight (a thread each) and a store client per address.

    `start` from the rank's command loop; `wait` (admission) returns once the read is whole or
    raises why it is not; `cancel` (an abort) ends it. Each read ends by itself when its sink closes.
    """

    def __init__(self) -> None:
        self._clients: dict[str, StateStoreClient] = {}
        self._reads: dict[str, _Read] = {}

    def start(self, request_id: str, sink: ShardingSink, source: StoreRead) -> None:
        set_cluster_token(source.cluster_token)
        client = self._clients.get(source.address)
        if client is None:
            client = self._clients[source.address] = StateStoreClient(
                source.address, timeout_s=READ_CLIENT_TIMEOUT_S
            )
        stream = client.get(
            source.key, timeout_s=source.timeout_s, wait_for_key=True, shared_memory=source.shared_memory
        )
        read = self._reads[request_id] = _Read(request_id, sink, stream, source.timeout_s)
        threading.Thread(target=read.run, name=f"rank-read-{request_id}", daemon=True).start()

    def wait(self, request_id: str) -> None:
        """Returns once this rank holds the request's state (nothing to wait for without a read)."""
        read = self._reads.pop(request_id, None)
        if read is not None:
            read.wait()

    def cancel(self, request_id: str) -> None:
        read = self._reads.pop(request_id, None)
        if read is not None:
            read.stream.cancel()


class _Read:
    def __init__(self, request_id: str, sink: ShardingSink, stream: ChunkStream, timeout_s: float) -> None:
        self.request_id, self.sink, self.stream, self.timeout_s = request_id, sink, stream, timeout_s
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            from splitserve.engine.state_codec import decode_pieces  # torch: see the imports

            for piece in decode_pieces(self.stream, kda_in_place=True):
                self.sink.write(piece)
            if not self.sink.complete:
                raise RuntimeError(f"state of {self.request_id} ended short: {self.sink.missing()}")
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def wait(self) -> None:
        if not self.done.wait(2 * self.timeout_s):
            self.stream.cancel()
            raise TimeoutError(f"state of {self.request_id} did not arrive within {2 * self.timeout_s:.0f} s")
        if self.error is not None:
            raise self.error
