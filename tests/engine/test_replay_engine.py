"""An engine decoding in ReplaySSM form gives the plain recurrent path's tokens (greedy, seeded, under
chunked prefill and preemption, 1-token prompts) and transformers' greedy tokens; its rings fold
every window; a prefill-only request's exported state is exact even when its last chunk was one token."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.state_transfer import LayerState
from tests.oracle import check_logprobs_close, engine_traces, hf_greedy

NUM_NEW_TOKENS = 21  # several windows of 4 and a partial one
PROMPT_LENGTHS = [1, 2, 5, 17, 40, 97]
WINDOW = 4


@pytest.fixture(scope="module")
def prompts(tiny_model_path) -> list[list[int]]:
    vocab = KimiLinearModelConfig.from_pretrained(tiny_model_path).vocab_size
    rng = random.Random(13)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=NUM_NEW_TOKENS, ignore_eos=True
    )


def _tokens(path, prompts, params, **engine_kwargs) -> tuple[LLM, list[list[int]]]:
    engine_kwargs.setdefault("max_model_len", 512)
    llm = LLM(model=str(path), dtype="float32", **engine_kwargs)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_equals_the_plain_path_and_transformers(tiny_model_path, prompts):
    llm = LLM(model=str(tiny_model_path), dtype="float32", max_model_len=512, replay_window=WINDOW)
    traces = engine_traces(llm.generate(prompt_token_ids=prompts, sampling_params=_greedy()))
    check_logprobs_close(hf_greedy(tiny_model_path, prompts, NUM_NEW_TOKENS), traces)
    ring = llm.engine.caches.replay
    assert ring is not None
    ring_bytes = sum(t[0].numel() * t.element_size() for r in ring.layers.values() for t in (r.k, r.u, r.g))
    assert llm.engine.plan.replay_ring_bytes == ring_bytes  # the budget pays for what is allocated
    _, plain = _tokens(tiny_model_path, prompts, _greedy())
    assert [t.token_ids for t in traces] == plain


@pytest.mark.parametrize("window", [1, 16])
def test_seeded_equals_the_plain_path_with_chunked_prefill(tiny_model_path, prompts, window):
    params = [_seeded(i) for i in range(len(prompts))]
    chunked = dict(max_num_batched_tokens=24, max_num_seqs=4)  # decodes and prompt chunks share steps
    _, plain = _tokens(tiny_model_path, prompts, params, **chunked)
    _, ring = _tokens(tiny_model_path, prompts, params, replay_window=window, **chunked)
    assert ring == plain


def test_greedy_equals_the_plain_path_under_preemption(tiny_model_path, prompts):
    config = KimiLinearModelConfig.from_pretrained(tiny_model_path)
    block_size, max_num_seqs = 16, 6
    unit = CachePlan.specs(config, block_size=block_size, dtype="float32", replay_window=WINDOW)
    num_blocks = -(-(max(PROMPT_LENGTHS) + NUM_NEW_TOKENS) // block_size) + 3  # not all of them fit
    kwargs = dict(
        kv_cache_memory_bytes=max_num_seqs * unit.slot_room_bytes + num_blocks * unit.block_bytes,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=32,
        max_model_len=max(PROMPT_LENGTHS) + NUM_NEW_TOKENS + 1,
    )
    llm, ring = _tokens(tiny_model_path, prompts, _greedy(), replay_window=WINDOW, **kwargs)
    assert llm.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    _, plain = _tokens(tiny_model_path, prompts, _greedy())
    assert ring == plain


def test_an_exported_state_is_exact_when_the_last_prompt_chunk_is_one_token(tiny_model_path, prompts):
    """A one-token chunk runs the single-row (ring) path; the export must still see the state."""
    prompt = prompts[4]  # 40 tokens in chunks of 39 + 1
    states: dict[tuple[int, str], torch.Tensor] = {}

    def keep(state: LayerState) -> None:
        states[(state.layer_id, str(state.kind))] = state.tensor

    exported = {}
    for window in (0, WINDOW):
        llm = LLM(
            model=str(tiny_model_path),
            dtype="float32",
            max_model_len=512,
            replay_window=window,
            max_num_batched_tokens=39,
        )
        states = {}
        llm.engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=2), export=keep)
        while llm.engine.has_unfinished_requests:
            llm.engine.step()
        exported[window] = states
    assert exported[0].keys() == exported[WINDOW].keys()
    for key, tensor in exported[0].items():
        torch.testing.assert_close(exported[WINDOW][key], tensor, atol=1e-5, rtol=1e-5)


def test_a_next_turn_hits_the_reply_a_ring_engine_retained(tiny_model_path, prompts):
    """Prefix caching keeps a finished request's prompt + reply: its KDA snapshot must be the
    state, not a ring's checkpoint (SnapshotPool.save flushes the slot). 18 decode steps leave 2
    records in a window of 4 when the request finishes (without the flush, tokens differ)."""
    caching = dict(enable_prefix_caching=True, prefix_unit=16, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True)
    llm, (reply,) = _tokens(tiny_model_path, [prompts[4]], params, replay_window=WINDOW, **caching)
    turn2 = [*prompts[4], *reply, *prompts[3]]
    outs = llm.generate(prompt_token_ids=[turn2], sampling_params=params)
    assert llm.engine.prefix_cache_stats().num_hit_tokens >= 48  # prompt + reply, in whole units
    _, plain = _tokens(tiny_model_path, [turn2], params)
    assert [list(outs[0].outputs[0].token_ids)] == plain
