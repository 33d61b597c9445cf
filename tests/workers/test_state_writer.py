"""The prefill's StateWriter: queues pieces without encoding them, and ships each MLA row once."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from prefill_worker.state_writer import StateWriter
from splitserve.engine.state_transfer import LayerState
from splitserve.state import Chunk, StateKind


class FakePut:
    def __init__(self) -> None:
        self.queued: list[Iterable[Chunk]] = []

    def write(self, chunks: Iterable[Chunk]) -> None:
        self.queued.append(chunks)


class FakeClient:
    def __init__(self) -> None:
        self.put = FakePut()

    def open_put(self, key: str, *, owner: str, lease_s: float) -> FakePut:
        return self.put


def _rows(start: int, end: int) -> LayerState:
    tensor = torch.arange(start, end, dtype=torch.float32).repeat_interleave(4).reshape(-1, 4)
    return LayerState(3, StateKind.MLA_KV, tensor, start, end, 100)


def test_rows_a_preempted_prefill_recomputes_are_not_sent_twice():
    client = FakeClient()
    writer = StateWriter(client, "key", "owner", 30.0)  # type: ignore[arg-type]
    for a, b in [(0, 40), (40, 64), (0, 50), (50, 80), (80, 100)]:  # preempted after 64, recomputed
        writer.write(_rows(a, b))
    chunks = [c for queued in client.put.queued for c in queued]
    assert [(c.meta.token_start, c.meta.token_end) for c in chunks] == [
        (0, 40),
        (40, 64),
        (64, 80),
        (80, 100),
    ]
    back = torch.cat(
        [torch.frombuffer(bytearray(c.data), dtype=torch.float32).reshape(-1, 4) for c in chunks]
    )
    assert torch.equal(back[:, 0], torch.arange(100, dtype=torch.float32))
    assert writer.num_bytes == 100 * 4 * 4


def test_writing_only_queues_a_lazy_encoding():
    client = FakeClient()
    writer = StateWriter(client, "key", "owner", 30.0)  # type: ignore[arg-type]
    state = _rows(0, 10)
    writer.write(state)
    state.tensor.zero_()  # not encoded yet: the sending thread reads the tensor when it runs
    (queued,) = client.put.queued
    (chunk,) = list(queued)
    assert chunk.data == bytes(10 * 4 * 4)
