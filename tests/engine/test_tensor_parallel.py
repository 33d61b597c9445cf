"""`LLM(model, tensor_parallel_size=N)` on the CPU: N rank processes joined by gloo give the tokens of one
rank (judged like vLLM's check_logprobs_close: fp32 sums in another order may move a near tie), with
and without expert parallelism, through chunked prefill, prefix-cache hits, preemption (recompute and
swap) and prompt logits; and every rank process ends with its engine, or when its driver dies."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.tiny_model import make_tiny_model
from tests.oracle import check_logprobs_close, engine_traces

NUM_NEW_TOKENS = 8
PROMPT_LENGTHS = [1, 5, 17, 64, 129]
# every size the tensor-parallel layers cut: MLA heads with a query LoRA, KDA heads, dense and shared
# MLPs, grouped routing over 8 experts, the vocabulary; an o_proj bias that only rank 0 may add
CHECKPOINT = dict(q_lora_rank=24, n_group=4, topk_group=2, attention_bias=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tp"), seed=11, **CHECKPOINT)
    vocab = KimiLinearModelConfig.from_pretrained(path).vocab_size
    rng = random.Random(5)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    shared = [rng.randrange(vocab) for _ in range(80)]  # two prompts over one prefix: a cache hit
    prompts += [shared + [rng.randrange(vocab) for _ in range(n)] for n in (3, 9)]
    return path, prompts


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)


def _generate(path, prompts, **engine_kwargs):
    llm = LLM(model=str(path), dtype="float32", max_model_len=400, **engine_kwargs)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params())
        return llm, engine_traces(outs)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference(checkpoint):
    path, prompts = checkpoint
    return _generate(path, prompts)[1]


def _ranks_ended(llm: LLM) -> list[int | None]:
    assert llm.engine.ranks is not None
    return [h.proc.poll() for h in llm.engine.ranks.handles]


@pytest.mark.parametrize("size,expert_parallel", [(2, False), (4, False), (2, True), (4, True)])
def test_tensor_parallel_gives_the_single_rank_tokens(checkpoint, reference, size, expert_parallel):
    path, prompts = checkpoint
    llm, traces = _generate(path, prompts, tensor_parallel_size=size, expert_parallel=expert_parallel)
    check_logprobs_close(reference, traces, min_matching=NUM_NEW_TOKENS // 2)
    assert _ranks_ended(llm) == [0] * (size - 1)  # shutdown ended every other rank's process


def test_prefix_hits_and_chunked_prefill_on_two_ranks(checkpoint, reference):
    path, prompts = checkpoint
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=400,
        tensor_parallel_size=2,
        enable_prefix_caching=True,
        max_num_batched_tokens=24,
    )
    try:
        check_logprobs_close(
            reference, engine_traces(llm.generate(prompt_token_ids=prompts, sampling_params=_params()))
        )
        again = engine_traces(llm.generate(prompt_token_ids=prompts[-2:], sampling_params=_params()))
        # the second time the shared prompts start from every rank's snapshot of their first run
        assert llm.engine.prefix_cache_stats().num_hit_tokens >= 2 * 64  # a whole prefix unit each
    finally:
        llm.shutdown()
    check_logprobs_close(reference[-2:], again, min_matching=NUM_NEW_TOKENS // 2)


def test_swap_preemption_with_replay_rings_on_two_ranks(checkpoint):
    """A KV budget for a quarter of the batch: decoding requests are swapped out and back (each rank
    its own shard of their state, ReplaySSM rings flushed first) and the tokens stay one rank's."""
    path, _ = checkpoint
    vocab = KimiLinearModelConfig.from_pretrained(path).vocab_size
    rng = random.Random(8)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 9, 17, 30, 41, 52)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    roomy = LLM(model=str(path), dtype="float32", max_model_len=128)
    reference = engine_traces(roomy.generate(prompt_token_ids=prompts, sampling_params=params))
    config = KimiLinearModelConfig.from_pretrained(path)
    unit = CachePlan.specs(config, block_size=4, dtype="float32", replay_window=4, tensor_parallel=2)
    num_blocks = (52 + 24) // 4 + 2  # the longest request fits, a quarter of the batch at once
    llm = LLM(
        model=str(path),
        dtype="float32",
        tensor_parallel_size=2,
        kv_cache_memory_bytes=8 * unit.slot_room_bytes + num_blocks * unit.block_bytes,
        block_size=4,
        max_num_seqs=8,
        max_model_len=52 + 24 + 1,
        preemption_mode="swap",
        replay_window=4,
    )
    try:
        traces = engine_traces(llm.generate(prompt_token_ids=prompts, sampling_params=params))
        assert llm.engine.swap_stats().num_swapped_in > 0, "the KV budget was meant to force swaps"
    finally:
        llm.shutdown()
    check_logprobs_close(reference, traces, min_matching=12)


def test_prompt_logits_on_two_ranks_match_one(checkpoint):
    path, prompts = checkpoint
    one = LLM(model=str(path), dtype="float32", max_model_len=400, max_num_batched_tokens=48)
    two = LLM(
        model=str(path), dtype="float32", max_model_len=400, max_num_batched_tokens=48, tensor_parallel_size=2
    )
    try:
        for prompt in (prompts[3], prompts[4]):
            torch.testing.assert_close(
                two.engine.prompt_logits(prompt), one.engine.prompt_logits(prompt), atol=1e-4, rtol=0
            )
        # bad input fails on every rank alike and the ranks stay in step
        with pytest.raises(ValueError, match="outside the vocabulary"):
            two.engine.prompt_logits([10**9])
        out = two.generate(prompt_token_ids=[prompts[1]], sampling_params=_params())
        assert len(out[0].outputs[0].token_ids) == NUM_NEW_TOKENS
    finally:
        two.shutdown()


def test_sizes_the_ranks_cannot_split_are_refused_before_any_rank_starts(checkpoint):
    path, _ = checkpoint
    with pytest.raises(
        ValueError, match=r"vocab_size \(2048\) does not split evenly over tensor_parallel_size 3"
    ):
        LLM(model=str(path), tensor_parallel_size=3)


def test_a_killed_rank_fails_the_next_step_instead_of_hanging(checkpoint):
    path, prompts = checkpoint
    llm = LLM(model=str(path), dtype="float32", max_model_len=400, tensor_parallel_size=2)
    try:
        assert llm.engine.ranks is not None
        rank = llm.engine.ranks.handles[0].proc
        rank.send_signal(signal.SIGKILL)
        rank.wait(timeout=30)
        with pytest.raises(RuntimeError):
            llm.generate(prompt_token_ids=[prompts[2]], sampling_params=_params())
    finally:
        llm.shutdown()


_DRIVER = """
import sys, time
from splitserve import LLM
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=64, tensor_parallel_size=2)
print(" ".join(str(h.pid) for h in llm.engine.ranks.handles), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_ranks_end_when_their_driver_is_killed(checkpoint):
    path, _ = checkpoint
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(path)], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        assert driver.stdout is not None
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert pids and all(_alive(p) for p in pids)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a rank outlived its driver"
    finally:
        driver.kill()
        driver.wait()
