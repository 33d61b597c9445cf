"""A transfer-engine reader's receive memory: registered once per slab, carved per read, a slab
reused once its pieces are dropped and unregistered once retired and dropped (no engine needed)."""

from __future__ import annotations

import gc

from splitserve.state.transport_mooncake import ReceiveSlabs


class FakeEngine:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.num_registrations = 0

    def register_memory(self, address: int, num_bytes: int) -> int:
        self.registered[address] = num_bytes
        self.num_registrations += 1
        return 0

    def unregister_memory(self, address: int) -> int:
        del self.registered[address]
        return 0


def test_a_slab_is_registered_once_and_reused_once_its_pieces_are_dropped() -> None:
    engine = FakeEngine()
    slabs = ReceiveSlabs(engine, slab_bytes=4096)
    first, first_address = slabs.take(1000)
    second, second_address = slabs.take(1000)
    assert engine.num_registrations == 1 and second_address >= first_address + 1000
    assert second_address % 64 == 0  # aligned for any dtype
    del first, second
    gc.collect()
    again, again_address = slabs.take(3000)  # all dropped: carved from the start again
    assert again_address == first_address and engine.num_registrations == 1
    assert again.nbytes == 3000


def test_a_full_slab_is_unregistered_when_its_last_piece_goes() -> None:
    engine = FakeEngine()
    slabs = ReceiveSlabs(engine, slab_bytes=4096)
    held, held_address = slabs.take(3000)
    big, _ = slabs.take(10_000)  # does not fit: a new slab of its size, the old one retired
    assert engine.num_registrations == 2 and held_address in engine.registered
    del held
    gc.collect()
    assert held_address not in engine.registered  # retired and empty: unregistered
    assert len(engine.registered) == 1 and big.nbytes == 10_000
