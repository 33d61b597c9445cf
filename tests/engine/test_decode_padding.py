"""Decode batches padded to a CUDA graph bucket, run eagerly on the CPU: the same tokens as unpadded
(greedy and seeded, ReplaySSM on and off, with and without prefill chunks in the step), padding only
ever on the scratch KV row and state slot, which no request is given; the graph runner's own
forward (static buffers, KV index and ReplaySSM record counts read in the graph) gives the same tokens
too; the switch off is the old engine."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.cuda_graph import DecodeGraphs
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.request import Request
from tests.engine.eager_graphs import EagerGraphs
from tests.oracle import check_logprobs_close, engine_traces

NUM_NEW_TOKENS = 14
PROMPT_LENGTHS = [1, 3, 9, 17, 40, 5, 70]
MAX_NUM_SEQS = 8  # buckets 1, 2, 4, 8: 7 rows pad to 8, 3 to 4, ...


@pytest.fixture(scope="module")
def prompts(tiny_model_path) -> list[list[int]]:
    vocab = KimiLinearModelConfig.from_pretrained(tiny_model_path).vocab_size
    rng = random.Random(7)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _params() -> list[SamplingParams]:
    """Greedy (with logprobs, to compare values too) and seeded rows in one batch."""
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=3)
    return [
        greedy
        if i % 2 == 0
        else SamplingParams(
            temperature=0.9, top_p=0.95, seed=40 + i, max_tokens=NUM_NEW_TOKENS, ignore_eos=True
        )
        for i in range(len(PROMPT_LENGTHS))
    ]


def _engine_kwargs(replay_window: int, mixed: bool) -> dict[str, object]:
    # mixed: a small token budget so prompt chunks share steps with decodes; else prompts finish first
    return dict(
        dtype="float32",
        max_model_len=256,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=24 if mixed else 512,
        replay_window=replay_window,
    )


def _generate(llm: LLM, prompts: Sequence[Sequence[int]], arrivals: bool) -> list:  # type: ignore[type-arg]
    if not arrivals:
        return llm.generate(prompt_token_ids=prompts, sampling_params=_params())
    # requests arrive while others decode: every batch size from 1 up, then down as they finish
    engine, params = llm.engine, _params()
    requests: list[Request] = []
    for i, prompt in enumerate(prompts):
        requests.append(engine.add_request(f"r{i}", list(prompt), params[i]))
        engine.step()
    while engine.has_unfinished_requests:
        engine.step()
    return [llm._output(r, None) for r in requests]


class _PaddingCounter:
    """Wraps `runner.build_batch` to count padded steps, and padded steps that also ran a prompt chunk."""

    def __init__(self, llm: LLM) -> None:
        self.padded = self.padded_mixed = 0
        runner = llm.engine.runner
        build = runner.build_batch

        def counting(singles, multis, num_padding=0, *rest):  # type: ignore[no-untyped-def]
            if num_padding:
                self.padded += 1
                self.padded_mixed += bool(multis)
            return build(singles, multis, num_padding, *rest)

        runner.build_batch = counting  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def unpadded(tiny_model_path, prompts):
    """Tokens and traces of the old engine, per (replay_window, mixed)."""
    cache: dict[tuple[int, bool], list] = {}  # type: ignore[type-arg]

    def get(replay_window: int, mixed: bool) -> list:  # type: ignore[type-arg]
        key = (replay_window, mixed)
        if key not in cache:
            llm = LLM(model=str(tiny_model_path), **_engine_kwargs(replay_window, mixed))
            assert llm.engine.padding is None and llm.engine.runner.graphs is None
            cache[key] = _generate(llm, prompts, arrivals=mixed)
        return cache[key]

    return get


def _check_same(padded: list, unpadded: list) -> None:  # type: ignore[type-arg]
    assert [list(o.outputs[0].token_ids) for o in padded] == [list(o.outputs[0].token_ids) for o in unpadded]
    greedy = slice(0, None, 2)
    check_logprobs_close(engine_traces(unpadded[greedy], k=3), engine_traces(padded[greedy], k=3), atol=1e-4)


@pytest.mark.parametrize("replay_window", [0, 4])
@pytest.mark.parametrize("mixed", [False, True])
def test_padded_decode_gives_the_unpadded_tokens(tiny_model_path, prompts, unpadded, replay_window, mixed):
    llm = LLM(model=str(tiny_model_path), pad_decode_batches=True, **_engine_kwargs(replay_window, mixed))
    padding = llm.engine.padding
    assert padding is not None and not padding.use_graphs and padding.batch_sizes == [1, 2, 4, 8]
    counter = _PaddingCounter(llm)
    outs = _generate(llm, prompts, arrivals=mixed)
    _check_same(outs, unpadded(replay_window, mixed))
    assert counter.padded > 0
    if mixed:
        assert counter.padded_mixed > 0  # padding rows sat between decodes and prompt chunks


def test_padding_rows_write_only_the_scratch_row_and_slot(tiny_model_path, prompts):
    llm = LLM(model=str(tiny_model_path), pad_decode_batches=True, **_engine_kwargs(0, False))
    engine, padding = llm.engine, llm.engine.padding
    assert padding is not None
    plan, caches, bs = engine.plan, engine.caches, engine.config.block_size
    assert (padding.scratch_block, padding.scratch_slot) == (plan.num_blocks, plan.num_slots)
    for kv in caches.mla_kv.values():
        assert kv.shape[0] == (plan.num_blocks + 1) * bs  # the plan's blocks and one scratch block
    for t in (*caches.kda_conv.values(), *caches.kda_recurrent.values()):
        assert t.shape[0] == plan.num_slots + 1
    # no allocator hands out the scratch ids, even when every block and slot is taken
    scheduler = engine.scheduler
    blocks = scheduler.blocks.allocate(scheduler.blocks.num_free_blocks)
    slots = [scheduler.slots.allocate() for _ in range(scheduler.slots.num_free_slots)]
    assert blocks is not None and padding.scratch_block not in blocks and max(blocks) < plan.num_blocks
    assert padding.scratch_slot not in slots and scheduler.slots.allocate() is None
    scheduler.blocks.free(blocks)
    for slot in slots:
        assert slot is not None
        scheduler.slots.free(slot)
    # three prompts: every decode step pads 3 rows to 4; the scratch row and slot take their writes
    llm.generate(prompt_token_ids=prompts[:3], sampling_params=_params()[:3])
    scratch_row = padding.scratch_block * bs
    assert all(kv[scratch_row].abs().sum() > 0 for kv in caches.mla_kv.values())
    assert all(t[padding.scratch_slot].abs().sum() > 0 for t in caches.kda_recurrent.values())


@pytest.mark.parametrize("replay_window", [0, 4])
@pytest.mark.parametrize("mixed", [False, True])
def test_graph_runner_forward_gives_the_unpadded_tokens(
    tiny_model_path, prompts, unpadded, mixed, replay_window
):
    llm = LLM(model=str(tiny_model_path), pad_decode_batches=True, **_engine_kwargs(replay_window, mixed))
    graphs = EagerGraphs.install(llm.engine)
    outs = _generate(llm, prompts, arrivals=mixed)
    _check_same(outs, unpadded(replay_window, mixed))
    assert graphs.num_runs > 0


def test_graph_runner_loads_padding_rows_on_the_scratch_block_and_slot(tiny_model_path):
    llm = LLM(model=str(tiny_model_path), pad_decode_batches=True, **_engine_kwargs(0, False))
    engine = llm.engine
    padding = engine.padding
    assert padding is not None
    graphs = DecodeGraphs(engine.model, engine.caches, padding, 16, 256, torch.device("cpu"))
    request = Request("a", list(range(3, 40)), SamplingParams(), 4, 0)
    request.block_table, request.state_slot, request.num_computed_tokens = [5, 2, 7], 3, 36
    graphs.load([request], 4)
    assert graphs.input_ids[:4].tolist() == [request.prompt_token_ids[36], 0, 0, 0]
    assert graphs.positions[:4].tolist() == [36, 0, 0, 0]
    assert graphs.slots[:4].tolist() == [3] + [padding.scratch_slot] * 3
    assert graphs.block_tables[0, :3].tolist() == [5, 2, 7]
    assert graphs.block_tables[1:4, 0].tolist() == [padding.scratch_block] * 3
    assert graphs.max_blocks == 16  # 256 tokens of 16: the graph's KV index spans max_model_len


def test_switch_off_is_the_old_engine(tiny_model_path):
    llm = LLM(model=str(tiny_model_path), **_engine_kwargs(0, False))
    engine = llm.engine
    assert engine.padding is None and engine.runner.padding is None and engine.runner.graphs is None
    for kv in engine.caches.mla_kv.values():
        assert kv.shape[0] == engine.plan.num_blocks * engine.config.block_size
    for t in engine.caches.kda_recurrent.values():
        assert t.shape[0] == engine.plan.num_slots
