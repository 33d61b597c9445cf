"""Scheduler decisions on their own: token budget, seq limit, preemption."""

from __future__ import annotations

from splitserve.engine.cache_pool import BlockAllocator, SlotAllocator
from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.sampling_params import SamplingParams


def _scheduler(num_blocks=64, max_num_seqs=4, budget=32, block_size=4):
    slots = SlotAllocator(max_num_seqs, LayerCaches({}, {}, {}))
    config = SchedulerConfig(max_num_seqs, budget, 1024, block_size)
    return Scheduler(config, BlockAllocator(num_blocks), slots)


def _req(i: int, n: int) -> Request:
    return Request(str(i), list(range(1, n + 1)), SamplingParams(), 8, i)


def _run_step(sched: Scheduler):
    out = sched.schedule()
    sampled = {s.request.request_id: 1 for s in out.scheduled if s.samples}
    sched.postprocess(out, sampled)
    return out


def test_budget_splits_a_long_prompt_into_chunks():
    sched = _scheduler(budget=10)
    sched.add(_req(0, 25))
    lengths = [_run_step(sched).scheduled[0].num_new_tokens for _ in range(3)]
    assert lengths == [10, 10, 5]
    assert sched.running[0].output_token_ids == [1]


def test_decodes_and_prefill_chunks_share_a_step():
    sched = _scheduler(budget=12)
    sched.add(_req(0, 3))
    _run_step(sched)
    sched.add(_req(1, 40))
    out = _run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("0", 1), ("1", 11)]


def test_max_num_seqs_caps_the_running_set():
    sched = _scheduler(max_num_seqs=2, budget=100)
    for i in range(3):
        sched.add(_req(i, 5))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_preemption_frees_the_newest_request_and_replays_it():
    sched = _scheduler(num_blocks=6, budget=64, block_size=4)  # 24 tokens of KV in all
    a, b = _req(0, 10), _req(1, 10)
    sched.add(a)
    sched.add(b)
    _run_step(sched)  # both prefilled: 3 + 3 blocks, pool empty
    assert sched.blocks.num_free_blocks == 0
    for _ in range(3):
        _run_step(sched)  # the third decode of a needs a 4th block -> b, the newest, is preempted
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert sched.num_preemptions >= 1
    assert a.status is RequestStatus.RUNNING
