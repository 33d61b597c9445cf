"""Prefill on one engine, move the state layer by layer, decode on another: same tokens as one engine."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.llm_engine import HANDOFF, LLMEngine
from splitserve.engine.state_transfer import LayerState, state_bytes
from splitserve.engine_config import EngineConfig
from splitserve.state import CorruptStateError, StateKind

PROMPTS = [[7, 8, 9], list(range(3, 120)), [44] * 33 + list(range(50, 90))]


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), max_model_len=512, **kw))


def _run_until_done(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests:
        engine.step()


def _disaggregated(path, params_list, prefill_kw=None):
    prefill, decode = _engine(path, **(prefill_kw or {})), _engine(path)
    states: dict[str, list[LayerState]] = {}
    requests = {}
    for i, (prompt, params) in enumerate(zip(PROMPTS, params_list)):
        rid = f"r{i}"
        states[rid] = []
        requests[rid] = prefill.add_request(rid, prompt, params, export=states[rid].append)
        assert decode.reserve_transfer(rid, len(prompt))
    _run_until_done(prefill)
    assert prefill.scheduler.blocks.num_free_blocks == prefill.plan.num_blocks  # prefill freed all
    outputs = {}
    for rid, request in requests.items():
        assert request.finish_reason == HANDOFF and len(request.output_token_ids) == 1
        for state in states[rid]:
            decode.write_transferred_state(rid, state)
        first = request.output_token_ids[0]
        lp = request.output_logprobs[0] if request.output_logprobs else None
        outputs[rid] = decode.admit_transferred(
            rid, PROMPTS[int(rid[1:])], params_list[int(rid[1:])], first, lp
        )
    _run_until_done(decode)
    return prefill, decode, states, [outputs[f"r{i}"].output_token_ids for i in range(len(PROMPTS))]


def _colocated(path, params_list):
    llm = LLM(model=str(path), max_model_len=512)
    return [
        o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params_list)
    ]


def test_every_layer_ships_its_state_once(tiny_model_path):
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * len(PROMPTS)
    prefill, _, states, _ = _disaggregated(tiny_model_path, params)
    config = prefill.model_config
    for prompt, shipped in zip(PROMPTS, states.values()):
        kinds = sorted({(s.layer_id, s.kind) for s in shipped})
        expected = sorted(
            [(lid, StateKind.MLA_KV) for lid in config.mla_layer_ids]
            + [
                (lid, k)
                for lid in config.kda_layer_ids
                for k in (StateKind.KDA_CONV, StateKind.KDA_RECURRENT)
            ]
        )
        assert kinds == expected
        for s in shipped:
            assert s.prompt_len == len(prompt)
            if s.kind == StateKind.MLA_KV:
                rows = s.token_end - s.token_start
                assert s.tensor.shape == (rows, config.kv_lora_rank + config.qk_rope_head_dim)
            else:
                assert (s.token_start, s.token_end) == (0, len(prompt))
            if s.kind == StateKind.KDA_RECURRENT:
                assert s.tensor.dtype == torch.float32 and s.tensor.abs().sum() > 0
        for lid in config.mla_layer_ids:  # every token's row exactly once, in order
            ranges = [(s.token_start, s.token_end) for s in shipped if s.layer_id == lid]
            assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]] and ranges[-1][1] == len(
                prompt
            )
        kda = [s for s in shipped if s.kind != StateKind.MLA_KV]
        assert len(kda) == 2 * len(config.kda_layer_ids)
        assert sum(s.num_bytes for s in shipped) == state_bytes(prefill.caches, len(prompt))


def test_a_chunked_prefill_streams_each_chunks_rows_as_it_runs(tiny_model_path):
    """With a 16-token budget, a 117-token prompt's MLA rows leave in 8 pieces per layer, the
    first ones steps before the prompt ends; KDA states leave once, after the last chunk."""
    prefill = _engine(tiny_model_path, max_num_batched_tokens=16)
    exported: list[tuple[int, LayerState]] = []
    steps = 0
    prompt = PROMPTS[1]
    prefill.add_request(
        "r", prompt, SamplingParams(max_tokens=2), export=lambda s: exported.append((steps, s))
    )
    while prefill.has_unfinished_requests:
        prefill.step()
        steps += 1
    assert steps == 8
    mla_id = prefill.model_config.mla_layer_ids[0]
    pieces = [(step, s.token_start, s.token_end) for step, s in exported if s.layer_id == mla_id]
    assert pieces == [(i, 16 * i, min(16 * (i + 1), len(prompt))) for i in range(8)]
    assert {step for step, s in exported if s.kind != StateKind.MLA_KV} == {7}


def test_chunked_prefill_disaggregated_equals_one_engine(tiny_model_path):
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * len(PROMPTS)
    _, _, _, tokens = _disaggregated(tiny_model_path, params, prefill_kw={"max_num_batched_tokens": 16})
    assert tokens == _colocated(tiny_model_path, params)


def test_admission_waits_for_every_token_of_every_layer(tiny_model_path):
    prefill, decode = _engine(tiny_model_path, max_num_batched_tokens=16), _engine(tiny_model_path)
    prompt, states = PROMPTS[1], []
    prefill.add_request("r", prompt, SamplingParams(max_tokens=2), export=states.append)
    _run_until_done(prefill)
    assert decode.reserve_transfer("r", len(prompt))
    last_mla = max(i for i, s in enumerate(states) if s.kind == StateKind.MLA_KV)
    for i, state in enumerate(states):
        if i != last_mla:
            decode.write_transferred_state("r", state)
    with pytest.raises(ValueError, match="incomplete"):
        decode.admit_transferred("r", prompt, SamplingParams(), 1)
    with pytest.raises(CorruptStateError, match="arrived twice"):
        decode.write_transferred_state("r", states[0])
    decode.write_transferred_state("r", states[last_mla])
    decode.admit_transferred("r", prompt, SamplingParams(max_tokens=3), 1)
    with pytest.raises(KeyError, match="no reservation"):
        decode.write_transferred_state("r", states[0])


def test_greedy_disaggregated_equals_one_engine(tiny_model_path):
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(PROMPTS)
    _, _, _, tokens = _disaggregated(tiny_model_path, params, prefill_kw={"max_num_batched_tokens": 32})
    assert tokens == _colocated(tiny_model_path, params)


def test_seeded_sampling_disaggregated_equals_one_engine(tiny_model_path):
    params = [
        SamplingParams(
            temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12, ignore_eos=True, repetition_penalty=1.2
        )
        for i in range(len(PROMPTS))
    ]
    _, _, _, tokens = _disaggregated(tiny_model_path, params)
    assert tokens == _colocated(tiny_model_path, params)


def test_decode_refuses_state_that_does_not_fit(tiny_model_path):
    decode = _engine(tiny_model_path)
    assert decode.reserve_transfer("x", 3)
    layer = decode.model_config.kda_layer_ids[0]
    with pytest.raises(ValueError, match="expected"):
        decode.write_transferred_state(
            "x", LayerState(layer, StateKind.KDA_RECURRENT, torch.zeros(2, 2), 0, 3)
        )
    with pytest.raises(ValueError, match="3 were reserved"):
        decode.write_transferred_state(
            "x", LayerState(layer, StateKind.KDA_RECURRENT, torch.zeros(2, 2), 0, 4)
        )
    with pytest.raises(KeyError, match="no reservation"):
        decode.write_transferred_state(
            "nope", LayerState(layer, StateKind.KDA_RECURRENT, torch.zeros(2, 2), 0, 3)
        )
    decode.abort_request("x")
    assert decode.scheduler.blocks.num_free_blocks == decode.plan.num_blocks
    assert decode.scheduler.slots.num_free_slots == decode.plan.num_slots


def test_reservations_count_against_max_num_seqs(tiny_model_path):
    decode = _engine(tiny_model_path, max_num_seqs=2)
    assert decode.reserve_transfer("a", 2)
    assert decode.reserve_transfer("b", 2)
    assert not decode.reserve_transfer("c", 2)


def test_a_reserved_room_is_untouched_by_steps_and_preemptions_around_it(tiny_model_path):
    """Steps that run, grow and preempt other requests never read, write or take the reserved
    blocks and slot (which is what lets another thread fill them while the engine steps)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = PROMPTS[1]
    prefill = _engine(tiny_model_path)
    states: list[LayerState] = []
    first = prefill.add_request("r", prompt, params, export=states.append)
    _run_until_done(prefill)
    block_bytes = 16 * 2 * 48 * 4  # block_size x MLA layers x (rank + rope) x fp32
    slot_bytes = 4 * (192 * 3 + 4 * 16 * 16) * 4  # KDA layers x (conv window + recurrent) x fp32
    decode = _engine(tiny_model_path, max_num_seqs=4, kv_cache_memory_bytes=4 * slot_bytes + 40 * block_bytes)
    assert decode.plan.num_blocks == 40
    assert decode.reserve_transfer("r", len(prompt))
    for state in states:
        decode.write_transferred_state("r", state)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(3):
        decode.add_request(f"other{i}", list(range(10 + i, 110 + i)), long)
    _run_until_done(decode)
    assert decode.scheduler.num_preemptions > 0
    request = decode.admit_transferred("r", prompt, params, first.output_token_ids[0])
    _run_until_done(decode)
    reference = LLM(model=str(tiny_model_path), max_model_len=512).generate(
        prompt_token_ids=[prompt], sampling_params=[params]
    )
    assert request.output_token_ids == reference[0].outputs[0].token_ids
