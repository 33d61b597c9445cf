"""KDA state chunks name their head ranges, and a reader of one width re-shards what writers of another
wrote: a rank's conv window, recurrent state and ReplaySSM records cut by heads, through chunks and the
wire and back, assemble into any other width's shares exactly; a live tensor-parallel rank's slot
holds exactly its heads of the single-rank state."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve import SamplingParams
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.parallel.heads import assemble, check_every_head, narrow_heads, rank_heads, take_heads
from splitserve.engine.state_codec import decode, decode_pieces, encode
from splitserve.engine.state_transfer import LayerState, extract_kda
from splitserve.engine_config import EngineConfig
from splitserve.state import ChunkMeta, CorruptStateError, HeadRange, InvalidChunkError, StateKind
from splitserve.state.wire import chunk_from_proto, chunk_to_proto

NUM_HEADS, HEAD_DIM, KEEP = 8, 4, 3


def _states() -> list[LayerState]:
    """One layer's conv window, recurrent state and ReplaySSM records, every head, random."""
    gen = torch.Generator().manual_seed(0)
    conv = torch.randn(3 * NUM_HEADS * HEAD_DIM, KEEP, generator=gen)
    recurrent = torch.randn(NUM_HEADS, HEAD_DIM, HEAD_DIM, generator=gen)
    records = torch.randn(5, NUM_HEADS, 3 * HEAD_DIM, generator=gen)
    return [
        LayerState(2, StateKind.KDA_CONV, conv, 0, 40),
        LayerState(2, StateKind.KDA_RECURRENT, recurrent, 0, 40),
        LayerState(2, StateKind.KDA_RECURRENT, records, 40, 45),  # token_start > 0: records
    ]


def test_a_conv_windows_heads_are_its_q_k_and_v_runs():
    conv = _states()[0]
    share = narrow_heads(conv, HeadRange(2, 4, NUM_HEADS))
    rows = [slice(part * 32 + 2 * HEAD_DIM, part * 32 + 4 * HEAD_DIM) for part in range(3)]
    torch.testing.assert_close(share.tensor, torch.cat([conv.tensor[r] for r in rows]), atol=0, rtol=0)
    assert share.heads == HeadRange(2, 4, NUM_HEADS)


@pytest.mark.parametrize("writers,readers", [(2, 1), (1, 4), (2, 4), (4, 2)])
def test_states_written_at_one_width_are_read_at_another(writers, readers):
    states = _states()
    key_of = {0: "key", 40: "key/replay/40/kda"}  # records live under their publish's key (replay_codec)
    stored: dict[str, list] = {key: [] for key in key_of.values()}
    for rank in range(writers):
        heads = rank_heads(NUM_HEADS, rank, writers)
        for state in states:
            share = narrow_heads(state, heads)
            # small chunks: a share spans several, and every chunk names the share's heads
            key = key_of[state.token_start]
            stored[key] += [
                chunk_from_proto(chunk_to_proto(c)) for c in encode(share, key, max_chunk_bytes=512)
            ]
    for chunks in stored.values():
        assert all((c.meta.heads is not None) == (writers > 1) for c in chunks)
        assert len({c.meta.id for c in chunks}) == len(chunks)  # ranks' objects never collide in a store
        random.Random(writers).shuffle(chunks)  # the ranks' writes interleave; each object stays in order
        chunks.sort(key=lambda c: (c.meta.id.head_start, c.meta.kind.value, c.meta.chunk_index))
    for read in (decode, decode_pieces):
        decoded = [piece for chunks in stored.values() for piece in read(chunks)]
        for rank in range(readers):
            want = rank_heads(NUM_HEADS, rank, readers)
            for state in states:
                pieces = [p for p in decoded if p.kind is state.kind and p.token_start == state.token_start]
                got = assemble(pieces, want)
                expected = narrow_heads(state, want)
                torch.testing.assert_close(got.tensor, expected.tensor, atol=0, rtol=0)
                assert got.heads == expected.heads == (want if readers > 1 else None)


def test_missing_heads_and_misnamed_chunks_are_errors():
    conv = _states()[0]
    half = narrow_heads(conv, HeadRange(0, 4, NUM_HEADS))
    with pytest.raises(Exception, match="hold 4 of the 8 heads"):
        assemble([half], HeadRange(0, 8, NUM_HEADS))
    with pytest.raises(InvalidChunkError, match="MLA rows hold every head's latent"):
        ChunkMeta("k", 0, StateKind.MLA_KV, "float32", (1, 4), 0, 1, 0, heads=HeadRange(0, 1, 2))
    with pytest.raises(InvalidChunkError, match=r"heads \[3, 3\) of 4 are not a range"):
        ChunkMeta("k", 0, StateKind.KDA_CONV, "float32", (1, 4), 0, 1, 0, heads=HeadRange(3, 3, 4))


def test_a_live_ranks_slot_holds_its_heads_of_the_single_rank_state(tiny_model_path):
    prompt = list(range(5, 60))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engines = [
        LLMEngine(EngineConfig(model=str(tiny_model_path), max_model_len=128, tensor_parallel_size=size))
        for size in (1, 2)
    ]
    try:
        requests = [e.add_request("r", prompt, params) for e in engines]
        for engine in engines:
            engine.step()  # the whole prompt, and the first token
        one, two = engines
        slots = [r.state_slot for r in requests]
        num_heads = one.model_config.linear_num_heads
        for layer in one.model_config.kda_layer_ids:
            whole = extract_kda(one.caches, layer, slots[0], len(prompt))
            ours = extract_kda(two.caches, layer, slots[1], len(prompt))  # rank 0's
            for full, rank0 in zip(whole, ours):
                expected = narrow_heads(full, rank_heads(num_heads, 0, 2))
                torch.testing.assert_close(rank0.tensor, expected.tensor, atol=1e-5, rtol=1e-5)
    finally:
        for engine in engines:
            engine.shutdown()


def test_two_ranks_shares_through_a_store_are_read_at_other_widths(tmp_path):
    """One rank puts its share as bytes, the other through the store's shared-memory arena (and
    seals the key): a reader of one rank, or of four, gets each its heads back exactly."""
    from splitserve.engine.state_codec import host_bytes
    from splitserve.state.client import StateStoreClient
    from state_store.arena import Arena
    from state_store.memory_tier import MemoryTier
    from state_store.server import StateStoreServer
    from state_store.store import StateStore

    store = StateStore(MemoryTier(64 << 20), arena=Arena(tmp_path / "arenas", pool_bytes=0))
    server = StateStoreServer(store)
    states = _states()[:2]  # a prompt's conv window and recurrent state
    try:
        with StateStoreClient(server.address, timeout_s=30) as client:
            one = [narrow_heads(s, rank_heads(NUM_HEADS, 1, 2)) for s in states]
            zero = [narrow_heads(s, rank_heads(NUM_HEADS, 0, 2)) for s in states]
            client.put([c for s in one for c in encode(s, "req")], owner="prefill")
            put = client.open_put("req", owner="prefill", shared_memory=True)
            for share in zero:
                data, dtype, shape = host_bytes(share.tensor)
                put.write_state(
                    share.layer_id,
                    share.kind,
                    data,
                    dtype=dtype,
                    shape=shape,
                    token_start=share.token_start,
                    token_end=share.token_end,
                    heads=share.heads,
                )
            put.finish(timeout_s=30)
            for shared_memory in (True, False):
                got = list(decode_pieces(client.get("req", timeout_s=30, shared_memory=shared_memory)))
                assert sorted(p.heads.start for p in got if p.heads is not None) == [0, 0, 4, 4]
                for readers in (1, 4):
                    for rank in range(readers):
                        want = rank_heads(NUM_HEADS, rank, readers)
                        for state in states:
                            share = assemble([p for p in got if p.kind is state.kind], want)
                            torch.testing.assert_close(
                                share.tensor, narrow_heads(state, want).tensor, atol=0, rtol=0
                            )
    finally:
        server.stop(grace_s=0)
        store.close()


def test_a_rank_takes_its_heads_of_a_whole_state_from_pieces_of_any_width():
    whole = _states()[:2]  # a conv window and a recurrent state
    mla = LayerState(1, StateKind.MLA_KV, torch.randn(40, 6), 0, 40)
    halves = [narrow_heads(s, rank_heads(NUM_HEADS, r, 2)) for s in whole for r in range(2)]
    for want in (
        rank_heads(NUM_HEADS, 1, 2),
        rank_heads(NUM_HEADS, 3, 4),
        HeadRange(0, NUM_HEADS, NUM_HEADS),
    ):
        taken = take_heads([mla, *halves], want)
        assert taken[0] is mla  # MLA rows whole, as they were
        for got, state in zip(taken[1:], whole):
            expected = narrow_heads(state, want) if want.end - want.start < NUM_HEADS else state
            torch.testing.assert_close(got.tensor, expected.tensor, atol=0, rtol=0)
    assert take_heads(halves, rank_heads(NUM_HEADS, 1, 2))[0] is halves[1]  # an exact piece is not copied


def test_a_state_missing_one_ranks_heads_is_refused():
    pieces = [narrow_heads(s, rank_heads(NUM_HEADS, r, 4)) for s in _states()[:2] for r in (0, 1, 3)]
    with pytest.raises(CorruptStateError, match="not every one of 8"):
        check_every_head(pieces, NUM_HEADS)
    with pytest.raises(CorruptStateError):
        take_heads(pieces, rank_heads(NUM_HEADS, 1, 2))  # heads 4..5 are nowhere
    check_every_head(pieces + [narrow_heads(_states()[i], rank_heads(NUM_HEADS, 2, 4)) for i in (0, 1)], 8)
