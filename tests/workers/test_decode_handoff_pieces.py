"""The decode's reader takes one-chunk KDA states in place (the sink copies them into the slot)."""

from __future__ import annotations

import torch

from splitserve.engine.state_codec import decode_pieces, encode
from splitserve.engine.state_transfer import LayerState
from splitserve.state import Chunk, StateKind


def _writable(chunk: Chunk) -> Chunk:
    """The chunk over a bytearray, so a test can see whether a tensor reads its bytes."""
    return Chunk(chunk.meta, bytearray(chunk.data))


def test_a_one_chunk_kda_state_is_read_in_place_and_a_cut_one_is_joined():
    gen = torch.Generator().manual_seed(0)
    conv = LayerState(0, StateKind.KDA_CONV, torch.randn(4, 24, generator=gen), 0, 50)
    recurrent = LayerState(0, StateKind.KDA_RECURRENT, torch.randn(4, 16, 16, generator=gen), 0, 50)
    (one_chunk,) = [_writable(c) for c in encode(conv, "key")]
    cut = [_writable(c) for c in encode(recurrent, "key", max_chunk_bytes=1024)]
    assert len(cut) > 1
    in_place, joined = decode_pieces([one_chunk, *cut], kda_in_place=True)
    (copied,) = decode_pieces([one_chunk])  # the default: a new tensor (for callers that keep it)
    assert torch.equal(in_place.tensor, conv.tensor) and torch.equal(copied.tensor, conv.tensor)
    assert torch.equal(joined.tensor, recurrent.tensor)
    one_chunk.data[:4] = bytes(4)  # the first float becomes 0.0
    assert in_place.tensor.flatten()[0].item() == 0.0  # read in place: no copy was made
    assert copied.tensor.flatten()[0].item() == conv.tensor.flatten()[0].item() != 0.0
    cut[0].data[:4] = bytes(4)
    assert joined.tensor.flatten()[0].item() == recurrent.tensor.flatten()[0].item()  # joined: a copy
