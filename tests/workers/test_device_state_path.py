"""A CUDA prefill's state reaches a CUDA decode on its node through the store's shared-memory
arena: device -> pinned buffer (one D2H copy on a side stream) -> arena region (one copy in),
then region -> pinned staging buffer -> the decode's cache (one H2D copy), never gRPC bytes and
never pageable memory next to the device.

Run on the CPU with the CUDA branch's own code: the prefill's StateWriter takes the device path
(`write_device_state`) for CPU tensors standing in for device ones, the decode's TransferSink is
made for a "cuda" device, and the CUDA calls are faked (tests/fake_cuda.py), so every copy of the
path runs and the store, the arena and both threads are real. What a GPU adds (the DMA engines)
is the `gpu`-marked test in tests/engine/test_host_staging.py.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import prefill_worker.state_writer as state_writer_module
from decode_worker.state_reader import StateReader
from prefill_worker.state_writer import StateWriter
from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.engine.state_codec import write_device_state
from splitserve.engine.state_transfer import LayerState, token_rows
from splitserve.engine.transfer_sink import TransferSink
from splitserve.state import StateKind
from splitserve.state.client import StateStoreClient
from state_store.arena import Arena
from state_store.memory_tier import MemoryTier
from state_store.server import StateStoreServer
from state_store.store import StateStore
from tests.fake_cuda import install_fake_cuda

WAIT_S = 30.0
NUM_TOKENS = 40


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[StateStore, str]]:
    state_store = StateStore(MemoryTier(64 << 20), arena=Arena(tmp_path / "arenas", pool_bytes=0))
    server = StateStoreServer(state_store, "127.0.0.1", 0)
    yield state_store, server.address
    server.stop(grace_s=0)
    state_store.close()


def _caches(device: str = "cpu") -> LayerCaches:
    """Two MLA layers (8 blocks of 8 rows of 24) and one KDA layer (4 slots), all zeros."""
    return LayerCaches(
        mla_kv={0: torch.zeros(64, 24, device=device), 2: torch.zeros(64, 24, device=device)},
        kda_conv={1: torch.zeros(4, 48, 3, device=device)},
        kda_recurrent={1: torch.zeros(4, 4, 16, 16, device=device)},
    )


def _prefill_pieces() -> list[LayerState]:
    """What a prefill exports: MLA rows per chunk (two chunks), then the KDA states."""
    gen = torch.Generator().manual_seed(0)
    pieces = []
    for layer in (0, 2):
        for start, end in ((0, 24), (24, NUM_TOKENS)):
            rows = torch.randn(end - start, 24, generator=gen)
            pieces.append(LayerState(layer, StateKind.MLA_KV, rows, start, end, NUM_TOKENS))
    pieces.append(LayerState(1, StateKind.KDA_CONV, torch.randn(48, 3, generator=gen), 0, NUM_TOKENS))
    pieces.append(
        LayerState(1, StateKind.KDA_RECURRENT, torch.randn(4, 16, 16, generator=gen), 0, NUM_TOKENS)
    )
    return pieces


def test_device_state_goes_through_pinned_buffers_and_the_arena(store, monkeypatch):
    cuda = install_fake_cuda(monkeypatch)
    # the writer's device path for CPU tensors standing in for device ones
    monkeypatch.setattr(state_writer_module, "write_state", write_device_state)
    state_store, address = store
    caches, slot = _caches(), 3
    rows = token_rows([5, 0, 7, 2, 6], NUM_TOKENS, block_size=8)
    pieces = _prefill_pieces()
    num_bytes = sum(p.num_bytes for p in pieces)
    with (
        StateStoreClient(address, timeout_s=WAIT_S) as prefill_client,
        StateStoreClient(address) as decode_client,
    ):
        sink = TransferSink(caches, rows, slot, NUM_TOKENS, torch.device("cuda"))
        reader = StateReader(sink, decode_client, "r0", "key", timeout_s=WAIT_S)
        writer = StateWriter(prefill_client, "key", "prefill", 60.0, num_bytes)
        for piece in pieces:  # the engine thread: queues each piece's copy, never waits for one
            writer.write(piece)
        writer.finish(WAIT_S)
        reader.wait(WAIT_S)
        info = state_store.lookup("key")
        assert info is not None
        # every piece was committed as a region of the arena, none as gRPC bytes
        assert info.chunks and all(state_store.location(meta) is not None for meta in info.chunks)
        reader.release()
    assert len(cuda.events) == len(pieces)  # one device-to-host copy per piece
    (waiter,) = {t for event in cuda.events for t in event.waiting_threads}
    assert waiter != threading.get_ident()  # the put's sending thread waited for them, not the engine's
    # pinned buffers: one per piece out, the decode's row indices, one per piece in
    assert len(cuda.pinned) == 2 * len(pieces) + 1
    assert reader.num_pieces == len(pieces) and sink.complete
    for layer in (0, 2):
        sent = torch.cat([p.tensor for p in pieces if p.layer_id == layer])
        assert torch.equal(caches.mla_kv[layer][rows], sent)
    assert torch.equal(caches.kda_conv[1][slot], pieces[-2].tensor)
    assert torch.equal(caches.kda_recurrent[1][slot], pieces[-1].tensor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_device_state_reaches_the_cache_through_the_arena(store):
    """The real thing: device tensors out of a "prefill" (the writes would raise under the sync
    debug mode if they synced), through the arena, into device caches of a "decode"."""
    state_store, address = store
    device = torch.device("cuda")
    caches = _caches("cuda")
    slot, rows = 3, token_rows([5, 0, 7, 2, 6], NUM_TOKENS, block_size=8)
    pieces = [dataclasses.replace(p, tensor=p.tensor.to(device)) for p in _prefill_pieces()]
    with (
        StateStoreClient(address, timeout_s=WAIT_S) as prefill_client,
        StateStoreClient(address) as decode_client,
    ):
        sink = TransferSink(caches, rows, slot, NUM_TOKENS, device)
        reader = StateReader(sink, decode_client, "r0", "key", timeout_s=WAIT_S)
        writer = StateWriter(prefill_client, "key", "prefill", 60.0, sum(p.num_bytes for p in pieces))
        torch.cuda.set_sync_debug_mode("error")
        try:
            for piece in pieces:
                writer.write(piece)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        writer.finish(WAIT_S)
        reader.wait(WAIT_S)
        info = state_store.lookup("key")
        assert info is not None and all(state_store.location(meta) is not None for meta in info.chunks)
        reader.release()
    for layer in (0, 2):
        sent = torch.cat([p.tensor for p in pieces if p.layer_id == layer])
        assert torch.equal(caches.mla_kv[layer][rows.to(device)], sent)
    assert torch.equal(caches.kda_conv[1][slot], pieces[-2].tensor)
    assert torch.equal(caches.kda_recurrent[1][slot], pieces[-1].tensor)
