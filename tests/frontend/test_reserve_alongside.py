"""The prefill starts while the decode reservation is in flight (frontend.generate): the gateway
names the state key and sends it to both; a refused reservation aborts the prefill and frees the
key in the store (sealed or not). Without known node stores (or with a colocated pool) the gateway still
reserves first."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from tests.frontend.conftest import MODEL, Gateway, running_gateway
from tests.frontend.fakes import FakeStore, FakeWorkerServer, Script


@contextmanager
def node_store(gw: Gateway) -> Iterator[FakeStore]:
    """A store on the workers' node, known to the router: the prefill may start beside the Reserve."""
    store = FakeStore()
    server = FakeWorkerServer(store)
    try:
        gw.router.update_stores(
            {a: server.address for a in (*gw.router.prefill_addresses, *gw.router.decode_addresses)}
        )
        yield store
    finally:
        server.stop()


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether `condition` came true within `timeout_s` (checked every 10 ms)."""
    idle = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        idle.wait(0.01)
    return condition()


def test_the_prefill_runs_while_the_reservation_is_held(tiny_model_path: Path, script: Script):
    with running_gateway(tiny_model_path, script) as gw:
        serial = gw.openai().completions.create(model=MODEL, prompt="p", max_tokens=4).choices[0].text
        assert (
            gw.prefill.requests[0].state_key == "state-" + gw.decode.reserves[0].request_id
        )  # Reserve named it
        with node_store(gw) as store:
            gw.decode.hold_reserve = threading.Event()
            with ThreadPoolExecutor(1) as pool:
                made = pool.submit(gw.openai().completions.create, model=MODEL, prompt="p", max_tokens=4)
                assert _until(lambda: len(gw.prefill.requests) == 2)  # sent before Reserve answered
                assert not made.done()
                gw.decode.hold_reserve.set()
                alongside = made.result(30).choices[0].text
        assert alongside == serial
        prefill, reserve, decode = gw.prefill.requests[1], gw.decode.reserves[1], gw.decode.decodes[1]
        assert prefill.state_key == reserve.state_key == decode.state.key != ""
        assert prefill.store_address == reserve.source_store_address == decode.state.store_address
        assert store.released == []  # the decode worker frees what it read, not the gateway


def test_a_refused_reservation_aborts_the_prefill_in_flight(tiny_model_path: Path, script: Script):
    with running_gateway(tiny_model_path, script) as gw, node_store(gw) as store:
        gw.decode.accept = False
        gw.decode.hold_reserve = gw.prefill.arrived  # refused only once the prefill is running
        gw.prefill.hold = threading.Event()  # the prefill runs until aborted
        with pytest.raises(openai.RateLimitError):
            gw.openai().with_options(max_retries=0).completions.create(model=MODEL, prompt="p", max_tokens=4)
        assert gw.prefill.aborted.wait(10)
        assert len(gw.prefill.requests) == 1 and gw.decode.decodes == []
        assert store.released == [gw.prefill.requests[0].state_key]  # what it wrote, and later writes


def test_a_state_sealed_before_the_refusal_is_released(tiny_model_path: Path, script: Script):
    with running_gateway(tiny_model_path, script) as gw, node_store(gw) as store:
        gw.decode.accept = False
        gw.decode.hold_reserve = threading.Event()
        (prefill_address,) = gw.router.prefill_addresses
        with ThreadPoolExecutor(1) as pool:
            made = pool.submit(
                gw.openai().with_options(max_retries=0).completions.create,
                model=MODEL,
                prompt="p",
                max_tokens=4,
            )
            assert _until(lambda: len(gw.prefill.requests) == 1)
            # the gateway has the prefill's answer (its state sealed) before the refusal comes
            assert _until(lambda: gw.router.outstanding_prefill_tokens(prefill_address) == 0)
            gw.decode.hold_reserve.set()
            with pytest.raises(openai.RateLimitError):
                made.result(30)
        assert store.released == [gw.prefill.requests[0].state_key]
        assert gw.decode.decodes == []


def test_a_decode_pool_believed_full_reserves_before_the_prefill(tiny_model_path: Path, script: Script):
    with running_gateway(tiny_model_path, script) as gw, node_store(gw):
        (decode_address,) = gw.router.decode_addresses
        gw.decode.stats.num_free_state_slots = 0
        gw.decode.accept = False
        assert _until(lambda: not gw.router.decode_has_room(decode_address))  # its Stats say full
        with pytest.raises(openai.RateLimitError):
            gw.openai().with_options(max_retries=0).completions.create(model=MODEL, prompt="p", max_tokens=4)
        assert gw.prefill.requests == []  # refused before any prefill work


def test_a_colocated_pool_reserves_first(tiny_model_path: Path, script: Script):
    with running_gateway(tiny_model_path, script, num_prefill=1, num_decode=1, colocated=True) as gw:
        with node_store(gw):
            gw.openai().completions.create(model=MODEL, prompt="p", max_tokens=4)
        (reserve,) = gw.decode.reserves
        assert reserve.state_key == ""  # the worker holding the room names the key and prefills
        assert gw.prefill.requests[0].state_key == "state-" + reserve.request_id
