"""State between a CUDA device and the host goes through pinned buffers, never pageable memory.

The CUDA branch's own code runs on CPU tensors with the CUDA calls faked (tests/fake_cuda.py):
out, one copy into a pinned buffer queued on a side stream behind the compute stream, waited for
by the reader of the buffer, not by the engine thread; in, one copy into a pinned buffer that the
side stream moves into the cache. A `gpu`-marked test runs the real thing.
"""

from __future__ import annotations

import threading

import pytest
import torch

from splitserve.engine import state_codec, transfer_sink
from splitserve.engine.host_staging import stage_pinned, to_pinned
from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.engine.state_codec import decode_pieces, encode, write_device_state, write_state
from splitserve.engine.state_transfer import LayerState, token_rows
from splitserve.engine.transfer_sink import TransferSink
from splitserve.state import StateKind
from tests.fake_cuda import FakeCuda, install_fake_cuda


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return install_fake_cuda(monkeypatch)


class RecordingPut:
    """Records what `write_state` queued, as a `PutStream` would hold it for its sending thread."""

    def __init__(self) -> None:
        self.queued: list[dict] = []

    def write_state(self, layer: int, kind: StateKind, data: memoryview, **fields: object) -> None:
        self.queued.append({"layer": layer, "kind": kind, "data": data, **fields})


def _on_another_thread(fn) -> int:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()
    return thread.ident  # type: ignore[return-value]


def test_a_device_tensor_leaves_through_one_pinned_copy_on_a_side_stream(fake_cuda):
    source = torch.randn(7, 5)
    copy = to_pinned(source)
    (side,) = fake_cuda.side_streams
    (done,) = fake_cuda.events
    assert fake_cuda.pinned == [copy.tensor]  # one pinned buffer: the copy's destination
    assert side.waited_for == [fake_cuda.compute]  # behind the compute stream's work, on the device
    assert done.stream is side and done.waiting_threads == []  # queued; nobody waited yet
    reader = _on_another_thread(copy.wait)
    assert done.waiting_threads == [reader]
    copy.wait()  # once done, waiting again waits for nothing
    assert done.waiting_threads == [reader]
    assert torch.equal(copy.tensor, source)
    to_pinned(torch.ones(3))
    assert len(fake_cuda.side_streams) == 1  # one side stream per device


def test_a_device_piece_is_queued_with_its_wait_and_read_from_the_pinned_buffer(fake_cuda):
    put = RecordingPut()
    state = LayerState(4, StateKind.MLA_KV, torch.randn(6, 8), 10, 16, 40)
    copy = write_device_state(put, state)
    (queued,) = put.queued
    assert queued["ready"] == copy.wait  # the put's sending thread calls it before reading
    assert fake_cuda.events[0].waiting_threads == []  # the engine thread did not wait
    (pinned,) = fake_cuda.pinned
    assert torch.frombuffer(queued["data"], dtype=torch.uint8).data_ptr() == pinned.data_ptr()
    assert (queued["shape"], queued["dtype"]) == ((6, 8), "float32")
    assert (queued["token_start"], queued["token_end"], queued["num_tokens"]) == (10, 16, 40)
    queued["ready"]()
    assert bytes(queued["data"]) == state.tensor.numpy().tobytes()


def test_write_state_sends_a_device_tensor_the_pinned_way_and_a_host_one_in_place(monkeypatch):
    taken: list[LayerState] = []
    monkeypatch.setattr(state_codec, "write_device_state", lambda put, state: taken.append(state))
    device_state = LayerState(0, StateKind.KDA_CONV, torch.empty(2, 3, device="meta"), 0, 5)
    write_state(RecordingPut(), device_state)
    assert taken == [device_state]
    put = RecordingPut()
    host = write_state(put, LayerState(0, StateKind.KDA_CONV, torch.ones(2, 3), 0, 5))
    assert taken == [device_state] and put.queued[0]["ready"] is None
    assert torch.frombuffer(put.queued[0]["data"], dtype=torch.uint8).data_ptr() == host.data_ptr()


def test_stage_pinned_copies_a_host_tensor_once_and_leaves_others_alone(fake_cuda):
    host = torch.arange(12.0).reshape(3, 4)
    staged = stage_pinned(host)
    assert fake_cuda.pinned == [staged] and torch.equal(staged, host)
    assert stage_pinned(torch.empty(2, device="meta")).device.type == "meta"  # a device tensor: as is
    assert len(fake_cuda.pinned) == 1


def _caches() -> LayerCaches:
    """One MLA layer (4 blocks of 8 rows of 6) and one KDA layer (3 slots), all zeros."""
    return LayerCaches(
        mla_kv={0: torch.zeros(32, 6)},
        kda_conv={1: torch.zeros(3, 12, 3)},
        kda_recurrent={1: torch.zeros(3, 2, 4, 4)},
    )


def _arriving_pieces(num_tokens: int) -> list[LayerState]:
    """A prompt's state as a reader gets it from the store: read-only views of the bytes."""
    states = [
        LayerState(0, StateKind.MLA_KV, torch.randn(9, 6), 0, 9, num_tokens),
        LayerState(0, StateKind.MLA_KV, torch.randn(num_tokens - 9, 6), 9, num_tokens, num_tokens),
        LayerState(1, StateKind.KDA_CONV, torch.randn(12, 3), 0, num_tokens),
        LayerState(1, StateKind.KDA_RECURRENT, torch.randn(2, 4, 4), 0, num_tokens),
    ]
    chunks = [chunk for state in states for chunk in encode(state, "key")]
    return list(decode_pieces(chunks, kda_in_place=True))


def test_a_cuda_sink_moves_each_piece_from_a_pinned_buffer_on_its_side_stream(fake_cuda, monkeypatch):
    written: list[torch.Tensor] = []
    real_write = transfer_sink.write_piece

    def spy(caches, state, rows, slot):  # what reaches the device copy, and on which stream
        assert fake_cuda.current_stream() is sink_stream
        written.append(state.tensor)
        real_write(caches, state, rows, slot)

    monkeypatch.setattr(transfer_sink, "write_piece", spy)
    caches, num_tokens, slot = _caches(), 13, 2
    rows = token_rows([3, 1], num_tokens, block_size=8)
    sink = TransferSink(caches, rows, slot, num_tokens, torch.device("cuda"))
    (sink_stream,) = fake_cuda.side_streams
    assert sink_stream.waited_for == [fake_cuda.compute]  # the slot's zeroing on the compute stream first
    pieces = _arriving_pieces(num_tokens)
    for piece in pieces:
        sink.write(piece)
    assert sink.complete
    assert len(fake_cuda.pinned) == 1 + len(pieces)  # the row indices once, then one per piece
    assert all(fake_cuda.is_pinned(t) for t in written)  # no piece went over from pageable memory
    assert sink_stream.num_syncs == len(pieces)  # each piece is in before it counts
    mla = torch.cat([p.tensor for p in pieces[:2]])
    assert torch.equal(caches.mla_kv[0][rows], mla)
    assert torch.equal(caches.kda_conv[1][slot], pieces[2].tensor)
    assert torch.equal(caches.kda_recurrent[1][slot], pieces[3].tensor)
    assert not caches.kda_recurrent[1][[0, 1]].any()  # the other slots untouched


def test_a_cpu_sink_writes_pieces_in_place_without_staging(fake_cuda):
    caches, num_tokens = _caches(), 13
    sink = TransferSink(caches, token_rows([3, 1], num_tokens, 8), 0, num_tokens, torch.device("cpu"))
    for piece in _arriving_pieces(num_tokens):
        sink.write(piece)
    assert sink.complete and fake_cuda.pinned == [] and fake_cuda.side_streams == []


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_the_pinned_path_on_a_gpu_never_syncs_the_compute_stream():
    """On a real device: the copy out is pinned and queued (a sync would raise under the sync
    debug mode), its bytes equal the device tensor's, and a piece comes back into a cache."""
    device = torch.device("cuda")
    source = torch.randn(4096, 96, device=device)
    expected = source.cpu()
    torch.cuda.set_sync_debug_mode("error")
    try:
        busy = source @ source.T  # work queued ahead on the compute stream
        copy = to_pinned(source)
        rows = stage_pinned(torch.arange(100))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    copy.wait()
    assert copy.tensor.is_pinned() and rows.is_pinned()
    assert torch.equal(copy.tensor, expected)
    del busy
    caches = LayerCaches(
        mla_kv={0: torch.zeros(4096, 96, device=device)},
        kda_conv={},
        kda_recurrent={},
    )
    sink = TransferSink(caches, torch.arange(4096), 0, 4096, device)
    piece = LayerState(0, StateKind.MLA_KV, expected, 0, 4096)
    sink.write(piece)
    assert sink.complete
    assert torch.equal(caches.mla_kv[0].cpu(), expected)
