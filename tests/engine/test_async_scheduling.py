"""Async scheduling (engine/step_pipeline.py) on the CPU: step N+1 is launched (scheduled, its inputs
built, `ModelRunner.execute` called) before step N's sampled ids are read on the host, a decode row
whose input is still on the device takes it there, and the tokens are the synchronous engine's and
transformers'; stops, aborts and preemption with a token pending lose nothing and leak nothing.

Order is observed, not timed: the runner's `execute` calls and each step's first read of its ids are
logged in the order they happen."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.host_pack import HostPack, long_tensor
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.pending_inputs import PendingInputs
from tests.engine.eager_graphs import EagerGraphs
from tests.engine.host_sync_guard import DEVICE, no_host_sync
from tests.oracle import check_logprobs_close, engine_traces, hf_greedy

NUM_NEW_TOKENS = 10
PROMPT_LENGTHS = [1, 5, 17, 40, 3]


@pytest.fixture(scope="module")
def prompts(tiny_model_path) -> list[list[int]]:
    vocab = KimiLinearModelConfig.from_pretrained(tiny_model_path).vocab_size
    rng = random.Random(11)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _llm(path: Any, async_scheduling: bool, **kwargs: Any) -> LLM:
    kwargs = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, **kwargs}
    return LLM(model=str(path), async_scheduling=async_scheduling, **kwargs)


def _greedy(max_tokens: int = NUM_NEW_TOKENS, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3, **kwargs)


def _mixed_params() -> list[SamplingParams]:
    """Greedy, seeded with cuts, min_tokens, different lengths, and one row with a penalty (whose
    step is finished at once: its next draw reads its output ids)."""
    return [
        _greedy(),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.7, top_k=20, seed=4, max_tokens=12, min_tokens=5, ignore_eos=True),
        _greedy(max_tokens=4),
        SamplingParams(temperature=0.8, seed=5, max_tokens=3, presence_penalty=0.5, ignore_eos=True),
    ]


class StepLog:
    """Logs, in the order they happen, each `execute` (a launch: which requests took their input id
    from the last step on the device) and each step's first read of its sampled ids on the host."""

    def __init__(self, engine: LLMEngine) -> None:
        self.events: list[tuple[str, int]] = []
        self.pending_rows: list[list[str]] = []  # per launch
        execute = engine.runner.execute

        def logged(scheduled, previous=None):  # type: ignore[no-untyped-def]
            step = len(self.pending_rows)
            self.pending_rows.append(
                [
                    s.request.request_id
                    for s in scheduled
                    if s.num_new_tokens == 1 and s.request.num_computed_tokens >= s.request.num_known_tokens
                ]
            )
            self.events.append(("launch", step))
            result = execute(scheduled, previous)
            read = result._read

            def logged_read() -> None:
                self.events.append(("read", step))
                read()

            result._read = logged_read
            return result

        engine.runner.execute = logged  # type: ignore[method-assign]

    def launched_before_read(self) -> list[int]:
        """The steps N whose ids were first read after step N+1 was launched."""
        order = {event: i for i, event in enumerate(self.events)}
        return [
            step
            for step in range(len(self.pending_rows) - 1)
            if ("read", step) in order and order[("launch", step + 1)] < order[("read", step)]
        ]

    def reads(self) -> list[int]:
        return [step for kind, step in self.events if kind == "read"]


def _tokens(outs: Sequence[Any]) -> list[list[tuple[list[int], str | None]]]:
    return [[(list(c.token_ids), c.finish_reason) for c in out.outputs] for out in outs]


def _logprobs(outs: Sequence[Any]) -> list[list[Any]]:
    return [[c.logprobs for c in out.outputs] for out in outs]


def _assert_free(engine: LLMEngine) -> None:
    """Nothing in flight and every block and slot back (the prefix cache may hold what it retained)."""
    scheduler = engine.scheduler
    assert not engine.has_unfinished_requests and not scheduler.running and not scheduler.waiting
    for request in engine.requests.values():
        assert request.num_pending_tokens == 0
    if scheduler.prefix_cache is None:
        assert scheduler.blocks.num_free_blocks == engine.plan.num_blocks
        assert scheduler.slots.num_free_slots == engine.plan.num_slots


def test_the_next_step_is_launched_before_the_last_ones_tokens_are_read(tiny_model_path, prompts):
    sync_llm, async_llm = _llm(tiny_model_path, False), _llm(tiny_model_path, True)
    assert async_llm.engine.async_scheduling and not sync_llm.engine.async_scheduling
    sync_log, async_log = StepLog(sync_llm.engine), StepLog(async_llm.engine)
    expected = sync_llm.generate(prompt_token_ids=prompts, sampling_params=_greedy())
    outs = async_llm.generate(prompt_token_ids=prompts, sampling_params=_greedy())

    assert _tokens(outs) == _tokens(expected)
    assert _logprobs(outs) == _logprobs(expected)
    # synchronous: each step's ids are read before the next is launched, and no input waits on the device
    assert sync_log.launched_before_read() == []
    assert not any(sync_log.pending_rows)
    # async: each decode step after the first is launched before the last one's ids are read, with
    # every running request's input id taken on the device; steps are read once each, in order
    num_steps = len(async_log.pending_rows)
    assert async_log.reads() == list(range(num_steps))
    overlapped = async_log.launched_before_read()
    assert len(overlapped) >= NUM_NEW_TOKENS - 2, async_log.events
    assert sum(len(rows) for rows in async_log.pending_rows) >= len(prompts) * (NUM_NEW_TOKENS - 2)
    assert num_steps == len(sync_log.pending_rows)  # no step computed more (each request stops in time)
    _assert_free(async_llm.engine)


def test_greedy_tokens_equal_transformers(tiny_model_path, prompts):
    reference = hf_greedy(tiny_model_path, prompts, NUM_NEW_TOKENS)
    llm = _llm(tiny_model_path, True, max_num_batched_tokens=24)  # prompt chunks share steps with decodes
    log = StepLog(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    check_logprobs_close(reference, engine_traces(outs))
    assert log.launched_before_read()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-runner"])
def test_mixed_sampling_equals_the_synchronous_engine(tiny_model_path, prompts, graphs):
    """Seeded draws count the pending token in their index, min_tokens too; a penalized row's step
    is read before the next launch; with the graph runner (its forward without the capture) a pending
    row's id is written into the static input buffer on the device."""
    kwargs: dict[str, Any] = {"max_num_batched_tokens": 24}
    if graphs:
        kwargs["pad_decode_batches"] = True
    results = []
    for async_scheduling in (False, True):
        llm = _llm(tiny_model_path, async_scheduling, **kwargs)
        engine = llm.engine
        eager_graphs = EagerGraphs.install(engine) if graphs else None
        log = StepLog(engine)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=_mixed_params())
        results.append((_tokens(outs), _logprobs(outs), log))
        _assert_free(engine)
        if eager_graphs is not None:
            assert eager_graphs.num_runs > 0
            assert bool(eager_graphs.num_pending_rows) == async_scheduling
    (sync_tokens, sync_logprobs, _), (async_tokens, async_logprobs, log) = results
    assert async_tokens == sync_tokens
    assert async_logprobs == sync_logprobs
    assert log.launched_before_read() and any(log.pending_rows)


def test_a_stop_token_read_late_drops_the_row_queued_after_it(tiny_model_path, prompts):
    """A request that stops at step N (its stop token is read after N+1 was launched with a row for
    it) ends there: the N+1 row's token is dropped, its blocks and slot come back."""
    sync_llm = _llm(tiny_model_path, False)
    plain = sync_llm.generate(prompt_token_ids=prompts, sampling_params=_greedy())
    stop_id = plain[3].outputs[0].token_ids[4]  # the 5th token of the 40-token prompt's reply
    params = _greedy(stop_token_ids=[stop_id])
    expected = sync_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert expected[3].outputs[0].finish_reason == "stop"
    assert expected[3].outputs[0].token_ids[-1] == stop_id

    llm = _llm(tiny_model_path, True)
    log = StepLog(llm.engine)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert _tokens(outs) == _tokens(expected)
    # the dropped row makes later steps one row wider than the synchronous engine's: same logprobs
    # up to float reassociation
    check_logprobs_close(engine_traces(expected, k=3), engine_traces(outs, k=3), atol=1e-5)
    stopped = outs[3].request_id
    num_rows = sum(stopped in rows for rows in log.pending_rows)
    # a row for each token it kept after the first, and one more: launched with the stop token as its
    # input, before that token was read
    assert num_rows == len(outs[3].outputs[0].token_ids)
    _assert_free(llm.engine)


def test_abort_with_a_step_in_flight(tiny_model_path, prompts):
    engine = _llm(tiny_model_path, True).engine
    expected = _llm(tiny_model_path, False).generate(prompt_token_ids=prompts[:2], sampling_params=_greedy())
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", prompt, _greedy())
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    for _ in range(50):
        if engine._steps.in_flight and len(got["r1"]) >= 2:
            break
        for update in engine.step():
            got[update.request.request_id] += update.new_token_ids
    assert engine._steps.in_flight and not engine.requests["r1"].finished
    aborted_at = len(got["r1"])
    engine.abort_request("r1")  # its next token is sampled on the device, not read
    while engine.has_unfinished_requests:
        for update in engine.step():
            got[update.request.request_id] += update.new_token_ids
    assert got["r0"] == list(expected[0].outputs[0].token_ids)
    assert len(got["r1"]) == aborted_at  # nothing came after the abort
    assert got["r1"] == list(expected[1].outputs[0].token_ids[:aborted_at])
    _assert_free(engine)


def test_preemption_with_a_token_pending_keeps_the_tokens(tiny_model_path, prompts):
    """A KV budget that fits one long request, not all: the scheduler preempts requests whose last
    token is still on the device; each is recomputed once that token is read, with the same tokens."""
    config = KimiLinearModelConfig.from_pretrained(tiny_model_path)
    max_model_len, block_size, max_num_seqs = 128, 16, 8
    unit = CachePlan.specs(config, block_size=block_size, dtype="float32")
    num_blocks = -(-max_model_len // block_size) + 1
    budget = max_num_seqs * unit.slot_bytes + num_blocks * unit.block_bytes
    kwargs = dict(
        kv_cache_memory_bytes=budget,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
    )
    params = _greedy(max_tokens=24)
    results = []
    for async_scheduling in (False, True):
        llm = _llm(tiny_model_path, async_scheduling, **kwargs)
        log = StepLog(llm.engine)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert llm.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
        results.append((_tokens(outs), _logprobs(outs)))
        _assert_free(llm.engine)
    assert results[1] == results[0]
    assert log.launched_before_read()


def test_a_pending_input_is_written_on_the_device_without_a_host_sync():
    """The rows of a step whose input id the last step sampled take it from that step's ids on the
    device: the row and source indices ride in the step's one host-to-device copy, nothing is read."""
    sampled = torch.empty(5, dtype=torch.long, device=DEVICE)  # the last step's ids, never on the host
    input_ids = torch.empty(4, dtype=torch.long, device=DEVICE)
    pending = PendingInputs(rows=[0, 2], sources=[4, 1], sampled=sampled)
    with torch.inference_mode(), no_host_sync() as guard:
        pack = HostPack()
        pack.add(long_tensor([7, 0, 9, 0]))
        ids = pending.queue(pack)
        pack.to(DEVICE)
        pending.fill(pack, ids, input_ids)
    assert guard.host_to_device == 1 and guard.device_to_host == 0
    # the same on the CPU, with values: rows 0 and 2 take sampled[4] and sampled[1]
    sampled, input_ids = torch.tensor([10, 11, 12, 13, 14]), torch.tensor([0, 8, 0, 9])
    pack = HostPack()
    ids = PendingInputs([0, 2], [4, 1], sampled).queue(pack)
    pack.to(torch.device("cpu"))
    PendingInputs([0, 2], [4, 1], sampled).fill(pack, ids, input_ids)
    assert input_ids.tolist() == [14, 8, 11, 9]
