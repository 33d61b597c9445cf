"""The prefill's StateWriter: queues pieces without copying them, and ships each MLA row once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prefill_worker.state_writer import HOLD_BYTES, StateWriter
from splitserve.engine.state_transfer import LayerState
from splitserve.state import StateKind


@dataclass
class Queued:
    layer: int
    kind: StateKind
    data: memoryview
    fields: dict[str, Any]


class FakePut:
    """Records what `write_state` queued (a real PutStream copies it on its sending thread)."""

    def __init__(self) -> None:
        self.queued: list[Queued] = []

    def write_state(self, layer: int, kind: StateKind, data: memoryview, **fields: Any) -> None:
        self.queued.append(Queued(layer, kind, data, fields))


class FakeClient:
    def __init__(self) -> None:
        self.put = FakePut()

    def open_put(
        self,
        key: str,
        *,
        owner: str,
        lease_s: float,
        expected_bytes: int | None,
        hold_bytes: int,
        warm_next: bool,
    ) -> FakePut:
        assert hold_bytes == HOLD_BYTES and warm_next
        return self.put


def _rows(start: int, end: int) -> LayerState:
    tensor = torch.arange(start, end, dtype=torch.float32).repeat_interleave(4).reshape(-1, 4)
    return LayerState(3, StateKind.MLA_KV, tensor, start, end, 100)


def test_rows_a_preempted_prefill_recomputes_are_not_sent_twice():
    client = FakeClient()
    writer = StateWriter(client, "key", "owner", 30.0)  # type: ignore[arg-type]
    for a, b in [(0, 40), (40, 64), (0, 50), (50, 80), (80, 100)]:  # preempted after 64, recomputed
        writer.write(_rows(a, b))
    queued = client.put.queued
    ranges = [(q.fields["token_start"], q.fields["token_end"]) for q in queued]
    assert ranges == [(0, 40), (40, 64), (64, 80), (80, 100)]
    assert {q.fields["num_tokens"] for q in queued} == {100}  # numbered by token in the store
    back = torch.cat(
        [torch.frombuffer(bytearray(q.data), dtype=torch.float32).reshape(-1, 4) for q in queued]
    )
    assert torch.equal(back[:, 0], torch.arange(100, dtype=torch.float32))
    assert writer.num_bytes == 100 * 4 * 4


def test_writing_queues_the_tensor_in_place_without_a_copy():
    client = FakeClient()
    writer = StateWriter(client, "key", "owner", 30.0)  # type: ignore[arg-type]
    state = LayerState(0, StateKind.KDA_RECURRENT, torch.ones(2, 3, 3), 0, 10)
    writer.write(state)
    state.tensor.zero_()  # the sending thread reads the tensor's own memory, so it sees this
    (queued,) = client.put.queued
    assert bytes(queued.data) == bytes(2 * 3 * 3 * 4)
    assert queued.fields["shape"] == (2, 3, 3) and queued.fields["dtype"] == "float32"
    assert queued.fields["num_tokens"] is None
