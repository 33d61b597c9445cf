"""Unclaimed state expires with its lease (injected clock, no sleeping); reads then fail clearly."""

from __future__ import annotations

import threading

import pytest

from splitserve.state.errors import LeaseExpiredError, StateNotFoundError
from state_store.leases import LeaseTable
from state_store.memory_tier import MemoryTier
from state_store.store import StateStore
from tests.state_store.conftest import FakeClock, make_chunk


def new_store(clock: FakeClock) -> StateStore:
    return StateStore(MemoryTier(1 << 20), default_lease_s=10.0, clock=clock)


def test_a_key_past_its_lease_is_freed_and_a_read_says_it_expired(clock: FakeClock) -> None:
    store = new_store(clock)
    store.put(make_chunk("req"), owner="w", final=True)
    clock.advance(9.9)
    assert store.lookup("req") is not None
    clock.advance(0.2)
    with pytest.raises(LeaseExpiredError, match="'req' expired"):
        list(store.get("req"))
    stats = store.stats()
    assert stats.num_expiries == 1 and stats.num_bytes == 0 and stats.num_keys == 0
    store.close()


def test_renew_and_a_put_with_lease_s_push_the_deadline(clock: FakeClock) -> None:
    store = new_store(clock)
    store.put(make_chunk("req", 0), owner="w", lease_s=5.0)
    clock.advance(4.0)
    store.put(make_chunk("req", 1), owner="w", lease_s=5.0)  # deadline now t+9
    clock.advance(4.0)
    assert store.renew("req", 30.0) == pytest.approx(30.0)
    clock.advance(29.0)
    info = store.lookup("req")
    assert info is not None and info.lease_remaining_s == pytest.approx(1.0)
    clock.advance(2.0)
    assert store.expire() == 1
    store.close()


def test_a_reader_waiting_on_a_key_is_woken_by_its_expiry(clock: FakeClock) -> None:
    store = new_store(clock)
    store.put(make_chunk("req"), owner="w")
    got_first = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in store.get("req", timeout_s=30.0):
                got_first.set()
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    assert got_first.wait(10.0)
    clock.advance(11.0)
    store.expire()  # what the server's reaper does
    reader.join(10.0)
    assert not reader.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], LeaseExpiredError)
    store.close()


def test_expired_keys_can_not_be_written_again(clock: FakeClock) -> None:
    store = new_store(clock)
    store.put(make_chunk("req", 0), owner="w")
    clock.advance(11.0)
    with pytest.raises(LeaseExpiredError, match="never written again"):
        store.put(make_chunk("req", 1), owner="w")
    store.close()


def test_unknown_keys_are_not_found_rather_than_expired(clock: FakeClock) -> None:
    store = new_store(clock)
    with pytest.raises(StateNotFoundError, match="no state under key 'nope'"):
        list(store.get("nope"))
    store.close()


def test_lease_table_pops_only_past_deadlines_in_order(clock: FakeClock) -> None:
    leases = LeaseTable(clock)
    leases.grant("a", "w", 5.0)
    leases.grant("b", "w", 1.0)
    leases.grant("c", "v", 3.0)
    leases.renew("b", 10.0)
    clock.advance(6.0)
    assert leases.pop_expired() == ["c", "a"]
    assert leases.keys_of("w") == ["b"] and leases.keys_of("v") == []
    with pytest.raises(ValueError, match="needs an owner"):
        leases.grant("d", "", 1.0)
