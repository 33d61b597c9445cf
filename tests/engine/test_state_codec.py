"""Layer states survive chunking byte for byte; chunks that do not add up fail loudly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from splitserve.engine.state_codec import decode, encode
from splitserve.engine.state_transfer import LayerState
from splitserve.state import DTYPE_ITEMSIZE, CorruptStateError, StateKind

CHUNK_BYTES = 64 * 1024


def _states() -> list[LayerState]:
    g = torch.Generator().manual_seed(0)
    return [
        LayerState(1, StateKind.MLA_KV, torch.randn(3000, 48, generator=g), 0, 3000),  # > 1 chunk
        LayerState(0, StateKind.KDA_CONV, torch.randn(96, 3, generator=g).bfloat16(), 0, 3000),
        LayerState(0, StateKind.KDA_RECURRENT, torch.randn(4, 16, 16, generator=g), 0, 3000),
    ]


def test_round_trip_is_exact_across_chunks():
    states = _states()
    chunks = [c for s in states for c in encode(s, "key", CHUNK_BYTES)]
    assert max(len(c.data) for c in chunks) <= CHUNK_BYTES
    assert sum(1 for c in chunks if c.meta.layer == 1) > 1
    assert all(c.meta.key == "key" for c in chunks)
    back = list(decode(chunks))
    assert [(b.layer_id, b.kind, b.token_start, b.token_end) for b in back] == [
        (s.layer_id, s.kind, s.token_start, s.token_end) for s in states
    ]
    for original, restored in zip(states, back):
        assert restored.tensor.dtype == original.tensor.dtype
        assert torch.equal(restored.tensor, original.tensor)


def test_encoding_is_lazy_and_reads_the_tensor_when_asked():
    state = _states()[2]
    chunks = encode(state, "key")
    state.tensor.zero_()  # nothing was cut yet: the chunks see the tensor as it is when iterated
    (restored,) = decode(chunks)
    assert torch.equal(restored.tensor, torch.zeros(4, 16, 16))


def test_truncated_stream_is_reported():
    chunks = list(encode(_states()[0], "key", CHUNK_BYTES))
    with pytest.raises(CorruptStateError, match="incomplete"):
        list(decode(chunks[:-1]))


def test_chunks_out_of_order_are_refused():
    chunks = list(encode(_states()[0], "key", CHUNK_BYTES))
    with pytest.raises(CorruptStateError, match="chunk 1/.* does not continue the 0 chunks"):
        list(decode(chunks[1:]))


def test_a_chunk_of_another_dtype_in_one_state_is_refused():
    first, second = list(encode(_states()[0], "key", CHUNK_BYTES))[:2]
    other = dataclasses.replace(second.meta, dtype="int32")
    with pytest.raises(CorruptStateError, match="int32 .* does not continue"):
        list(decode([first, dataclasses.replace(second, meta=other)]))


def test_every_state_dtype_name_is_a_torch_dtype_of_that_size():
    for name, itemsize in DTYPE_ITEMSIZE.items():
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype) and dtype.itemsize == itemsize, name
