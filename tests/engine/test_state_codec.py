"""Layer states survive chunking byte for byte; any corrupted byte fails loudly."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import state_codec
from splitserve.engine.state_codec import CorruptStateError, decode, encode, seal
from splitserve.engine.state_transfer import KDA_CONV, KDA_RECURRENT, MLA_KV, LayerState


def _states() -> list[LayerState]:
    g = torch.Generator().manual_seed(0)
    return [
        LayerState(1, MLA_KV, torch.randn(3000, 48, generator=g), 0, 3000),  # > 1 chunk at 64 KiB
        LayerState(0, KDA_CONV, torch.randn(96, 3, generator=g).bfloat16(), 0, 3000),
        LayerState(0, KDA_RECURRENT, torch.randn(4, 16, 16, generator=g), 0, 3000),
    ]


def test_round_trip_is_exact_across_chunks(monkeypatch):
    monkeypatch.setattr(state_codec, "CHUNK_BYTES", 64 * 1024)
    states = _states()
    chunks = [c for s in states for c in encode(s, "key", "owner")] + [seal("key", "owner")]
    assert max(len(c.data) for c in chunks) <= 64 * 1024
    assert sum(1 for c in chunks if c.layer == 1 and c.kind) > 1
    back = list(decode(chunks))
    assert [(b.layer_id, b.kind, b.token_end) for b in back] == [
        (s.layer_id, s.kind, s.token_end) for s in states
    ]
    for original, restored in zip(states, back):
        assert restored.tensor.dtype == original.tensor.dtype
        assert torch.equal(restored.tensor, original.tensor)


def test_flipped_byte_fails_the_checksum():
    chunks = list(encode(_states()[2], "key", "owner"))
    data = bytearray(chunks[0].data)
    data[17] ^= 0x01
    chunks[0].data = bytes(data)
    with pytest.raises(CorruptStateError, match="failed its checksum"):
        list(decode(chunks))


def test_truncated_stream_is_reported(monkeypatch):
    monkeypatch.setattr(state_codec, "CHUNK_BYTES", 64 * 1024)
    chunks = list(encode(_states()[0], "key", "owner"))
    with pytest.raises(CorruptStateError, match="incomplete"):
        list(decode(chunks[:-1]))
