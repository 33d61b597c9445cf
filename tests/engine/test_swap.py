"""Swap preemption: a KV budget too small for the batch forces preemptions; with
`preemption_mode="swap"` the decoding victims' states go to the swap space and come back, and
the tokens (greedy and seeded, with ReplaySSM rings and prefix caching too) equal recompute
preemption, an engine that never preempts, and transformers. A swapped request computes each of
its tokens once. A full swap space, or one that loses a state, falls back to recompute with the
same tokens."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.state_transfer import LayerState
from splitserve.engine.swap_space import HostSwapSpace
from tests.oracle import check_logprobs_close, engine_traces, hf_greedy

NUM_NEW_TOKENS = 24
PROMPT_LENGTHS = [3, 9, 17, 30, 41, 52, 60, 75]
BLOCK_SIZE = 4
MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def prompts(tiny_model_path) -> list[list[int]]:
    vocab = KimiLinearModelConfig.from_pretrained(tiny_model_path).vocab_size
    rng = random.Random(15)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def unpreempted(tiny_model_path, prompts) -> dict[str, list[list[int]]]:
    """Greedy and seeded tokens of an engine with room for the whole batch (never preempts)."""
    return {
        name: _run(tiny_model_path, prompts, params, max_model_len=512)[1]
        for name, params in (("greedy", _greedy()), ("seeded", _seeded()))
    }


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)


def _seeded() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.9, top_p=0.95, seed=300 + i, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        for i in range(len(PROMPT_LENGTHS))
    ]


def _tight(path, replay_window: int = 0, **overrides: Any) -> dict[str, Any]:
    """Engine kwargs whose KV blocks hold about a quarter of the batch's tokens: it must preempt."""
    config = KimiLinearModelConfig.from_pretrained(path)
    unit = CachePlan.specs(config, block_size=BLOCK_SIZE, dtype="float32", replay_window=replay_window)
    needed = sum(-(-(n + NUM_NEW_TOKENS) // BLOCK_SIZE) for n in PROMPT_LENGTHS)
    num_blocks = max(needed // 4, -(-(max(PROMPT_LENGTHS) + NUM_NEW_TOKENS) // BLOCK_SIZE) + 1)
    kwargs: dict[str, Any] = dict(
        kv_cache_memory_bytes=MAX_NUM_SEQS * unit.slot_room_bytes + num_blocks * unit.block_bytes,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=128,
        max_model_len=max(PROMPT_LENGTHS) + NUM_NEW_TOKENS + 1,
        replay_window=replay_window,
    )
    return {**kwargs, **overrides}


class Counted:
    """What the engine's steps computed per request, and which requests it restarted from 0."""

    def __init__(self, engine: LLMEngine) -> None:
        self.tokens: Counter[str] = Counter()
        self.restarted: set[str] = set()
        execute, restart = engine.runner.execute, engine.scheduler._restart

        def counted_execute(scheduled, *rest):  # type: ignore[no-untyped-def]
            for s in scheduled:
                self.tokens[s.request.request_id] += s.num_new_tokens
            return execute(scheduled, *rest)

        def counted_restart(request):  # type: ignore[no-untyped-def]
            self.restarted.add(request.request_id)
            restart(request)

        engine.runner.execute = counted_execute  # type: ignore[method-assign]
        engine.scheduler._restart = counted_restart  # type: ignore[method-assign]


def _run(path, prompts, params, **engine_kwargs: Any) -> tuple[LLM, list[list[int]], Counted]:
    llm = LLM(model=str(path), dtype="float32", num_threads=1, **engine_kwargs)
    counted = Counted(llm.engine)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    _check_all_free(llm.engine)
    return llm, [list(o.outputs[0].token_ids) for o in outs], counted


def _check_all_free(engine: LLMEngine) -> None:
    sched = engine.scheduler
    if engine.prefix_cache is None:
        assert sched.blocks.num_free_blocks == engine.plan.num_blocks
    assert sched.slots.num_free_slots == engine.plan.num_slots
    assert not sched.swapped
    if isinstance(getattr(engine.swapper, "space", None), HostSwapSpace):
        assert engine.swapper.space.used_bytes == 0  # type: ignore[union-attr]


def _check_swapped_without_recompute(llm: LLM, counted: Counted, prompts: list[list[int]]) -> None:
    stats = llm.engine.swap_stats()
    assert stats.num_swapped_out > 0, "the KV budget was meant to force swaps"
    assert stats.num_swapped_in == stats.num_swapped_out
    assert stats.num_recompute_fallbacks == 0
    assert stats.num_swap_in_bytes == stats.num_swap_out_bytes > 0
    # every request not restarted from 0 computed each of its tokens once (the last is only sampled)
    kept = [str(i) for i in range(len(prompts)) if str(i) not in counted.restarted]
    assert kept
    for rid in kept:
        assert counted.tokens[rid] == len(prompts[int(rid)]) + NUM_NEW_TOKENS - 1, rid


@pytest.mark.parametrize("replay_window", [0, 4])
def test_greedy_swap_equals_recompute_no_preemption_and_transformers(
    tiny_model_path, prompts, unpreempted, replay_window
):
    swap, swapped, counted = _run(
        tiny_model_path, prompts, _greedy(), **_tight(tiny_model_path, replay_window, preemption_mode="swap")
    )
    _check_swapped_without_recompute(swap, counted, prompts)
    recompute, recomputed, _ = _run(
        tiny_model_path, prompts, _greedy(), **_tight(tiny_model_path, replay_window)
    )
    assert recompute.engine.scheduler.num_preemptions > 0
    assert recompute.engine.swap_stats().num_swapped_out == 0
    assert swapped == recomputed == unpreempted["greedy"]
    if replay_window == 0:  # transformers once: the ring path equals the plain one above
        outs = swap.generate(prompt_token_ids=prompts, sampling_params=_greedy())
        check_logprobs_close(hf_greedy(tiny_model_path, prompts, NUM_NEW_TOKENS), engine_traces(outs))


@pytest.mark.parametrize("replay_window", [0, 4])
def test_seeded_swap_equals_recompute_and_no_preemption(tiny_model_path, prompts, unpreempted, replay_window):
    swap, swapped, counted = _run(
        tiny_model_path, prompts, _seeded(), **_tight(tiny_model_path, replay_window, preemption_mode="swap")
    )
    _check_swapped_without_recompute(swap, counted, prompts)
    assert swapped == unpreempted["seeded"]
    if replay_window == 0:  # recompute preemption with rings is test_replay_engine's
        _, recomputed, _ = _run(tiny_model_path, prompts, _seeded(), **_tight(tiny_model_path))
        assert recomputed == swapped


def test_swap_with_prefix_caching_equals_caching_off(tiny_model_path, prompts):
    """A first request leaves a prefix the batch's first four share: swapped requests hold
    shared blocks when they go out, and come back into private ones."""
    first = prompts[-1][:32]  # the longest turn still fits max_model_len
    turns = [first + p for p in prompts[:4]] + prompts[4:]
    caching = dict(enable_prefix_caching=True, prefix_unit=BLOCK_SIZE)
    kwargs = _tight(tiny_model_path, 0, preemption_mode="swap", **caching)
    tokens = {}
    for name, engine_kwargs in (("swap", kwargs), ("plain", dict(max_model_len=512))):
        llm = LLM(model=str(tiny_model_path), dtype="float32", num_threads=1, **engine_kwargs)
        outs = llm.generate(prompt_token_ids=[first, *turns], sampling_params=[_greedy(), *_seeded()])
        outs += llm.generate(prompt_token_ids=turns, sampling_params=_seeded())
        tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        _check_all_free(llm.engine)
        if name == "swap":
            assert llm.engine.swap_stats().num_swapped_out > 0
            assert llm.engine.prefix_cache_stats().num_hit_tokens > 0
    assert tokens["swap"] == tokens["plain"]


@pytest.mark.parametrize("budget_states", [0, 1])
def test_a_full_swap_space_falls_back_to_recompute_with_the_same_tokens(
    tiny_model_path, prompts, unpreempted, budget_states
):
    """Room for no state, then for one: the requests that do not fit are recomputed."""
    config = KimiLinearModelConfig.from_pretrained(tiny_model_path)
    unit = CachePlan.specs(config, block_size=BLOCK_SIZE, dtype="float32")
    longest = max(PROMPT_LENGTHS) + NUM_NEW_TOKENS
    one_state = unit.slot_room_bytes + longest * unit.block_bytes // BLOCK_SIZE
    kwargs = _tight(tiny_model_path, preemption_mode="swap", swap_space_bytes=budget_states * one_state)
    llm, tokens, _ = _run(tiny_model_path, prompts, _greedy(), **kwargs)
    stats = llm.engine.swap_stats()
    assert stats.num_recompute_fallbacks > 0
    assert (stats.num_swapped_out > 0) == (budget_states > 0)
    assert tokens == unpreempted["greedy"]


class Forgetful(HostSwapSpace):
    """Loses the first of every two states it gives back, and gives back every other second one
    incomplete (as a failing store would)."""

    def __init__(self) -> None:
        super().__init__(2**40)
        self.num_takes = 0

    def take(self, request_id: str) -> list[LayerState] | None:
        self.num_takes += 1
        states = super().take(request_id)
        if self.num_takes % 2:
            return None
        return states[1:] if self.num_takes % 4 == 0 and states else states


def test_a_lost_swapped_state_is_recomputed_with_the_same_tokens(tiny_model_path, prompts, unpreempted):
    llm = LLM(model=str(tiny_model_path), dtype="float32", **_tight(tiny_model_path, preemption_mode="swap"))
    space = Forgetful()
    llm.engine.set_swap_space(space)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_seeded())
    stats = llm.engine.swap_stats()
    assert stats.num_recompute_fallbacks > 0 and stats.num_swapped_in > 0
    assert stats.num_recompute_fallbacks + stats.num_swapped_in == stats.num_swapped_out == space.num_takes
    _check_all_free(llm.engine)
    assert [list(o.outputs[0].token_ids) for o in outs] == unpreempted["seeded"]


def test_an_aborted_swapped_request_frees_its_swapped_state(tiny_model_path, prompts):
    llm = LLM(model=str(tiny_model_path), dtype="float32", **_tight(tiny_model_path, preemption_mode="swap"))
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, _greedy())
    while not engine.scheduler.swapped:
        assert engine.has_unfinished_requests, "nothing was swapped out"
        engine.step()
    space = engine.swapper.space  # type: ignore[union-attr]
    assert isinstance(space, HostSwapSpace) and space.used_bytes > 0
    for rid in list(engine.scheduler.swapped):
        engine.abort_request(rid)
    assert not engine.scheduler.swapped
    while engine.has_unfinished_requests:
        engine.step()
    _check_all_free(engine)


def test_recompute_mode_has_no_swap_space(tiny_model_path):
    llm = LLM(model=str(tiny_model_path), dtype="float32", max_model_len=64)
    assert llm.engine.swapper is None
    with pytest.raises(ValueError, match="preemption_mode='swap'"):
        llm.engine.set_swap_space(HostSwapSpace(1))
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        LLM(model=str(tiny_model_path), preemption_mode="offload")
