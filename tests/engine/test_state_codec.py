"""Layer states survive chunking byte for byte; chunks that do not add up fail loudly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from splitserve.engine.state_codec import decode, decode_pieces, encode
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
    with pytest.raises(CorruptStateError, match="mla_kv chunk 341/3000 .* does not continue the 0 chunks"):
        list(decode(chunks[1:]))
    kda = list(encode(_states()[2], "key", 1024))
    with pytest.raises(CorruptStateError, match="chunk 1/4 .* does not continue the 0 chunks"):
        list(decode(kda[1:]))


def test_a_chunk_of_another_dtype_in_one_state_is_refused():
    first, second = list(encode(_states()[0], "key", CHUNK_BYTES))[:2]
    other = dataclasses.replace(second.meta, dtype="int32")
    with pytest.raises(CorruptStateError, match="int32 .* does not continue"):
        list(decode([first, dataclasses.replace(second, meta=other)]))


def test_every_state_dtype_name_is_a_torch_dtype_of_that_size():
    for name, itemsize in DTYPE_ITEMSIZE.items():
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype) and dtype.itemsize == itemsize, name


def test_mla_chunks_are_numbered_by_token_so_pieces_of_one_layer_never_collide():
    rows = torch.randn(100, 48, generator=torch.Generator().manual_seed(1))
    pieces = [
        LayerState(1, StateKind.MLA_KV, rows[a:b], a, b, 100) for a, b in ((0, 40), (40, 64), (64, 100))
    ]
    chunks = [c for p in pieces for c in encode(p, "key", 16 * 48 * 4)]  # 16 rows a chunk
    ids = [c.meta.chunk_index for c in chunks]
    assert ids == [0, 16, 32, 40, 56, 64, 80, 96] and {c.meta.num_chunks for c in chunks} == {100}
    (whole,) = decode(chunks)  # whole-state decoding joins the pieces
    assert (whole.token_start, whole.token_end) == (0, 100) and torch.equal(whole.tensor, rows)


def test_decode_pieces_hands_each_mla_chunk_over_as_it_lands_and_kda_states_whole():
    states = _states()
    mla_chunks = list(encode(states[0], "key", CHUNK_BYTES))
    kda_chunks = [c for s in states[1:] for c in encode(s, "key", 1024)]
    out = list(decode_pieces(mla_chunks + kda_chunks))
    mla = [p for p in out if p.kind is StateKind.MLA_KV]
    assert len(mla) == len(mla_chunks) > 1
    assert torch.equal(torch.cat([p.tensor for p in mla]), states[0].tensor)
    assert all(p.prompt_len == 3000 for p in out)
    kda = [p for p in out if p.kind is not StateKind.MLA_KV]
    assert [p.kind for p in kda] == [StateKind.KDA_CONV, StateKind.KDA_RECURRENT]
    assert torch.equal(kda[1].tensor, states[2].tensor)
    with pytest.raises(CorruptStateError, match="incomplete KDA"):
        list(decode_pieces(kda_chunks[:-1]))


def test_an_mla_chunk_not_numbered_by_its_token_is_refused():
    (chunk,) = list(encode(LayerState(1, StateKind.MLA_KV, torch.zeros(4, 2), 4, 8, 8), "key"))
    bad = dataclasses.replace(chunk, meta=dataclasses.replace(chunk.meta, chunk_index=0))
    with pytest.raises(CorruptStateError, match="numbered by its first token"):
        list(decode_pieces([bad]))
