"""On CUDA, decode steps replayed from CUDA graphs give the eager engine's tokens at every batch size
1..N (greedy and seeded, fp32, ReplaySSM on and off); on the CPU, a capture that fails leaves the engine eager and unpadded."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.cuda_graph_plan import DecodePadding
from splitserve.engine.model_runner import ModelRunner

MAX_NUM_SEQS = 8
NUM_NEW_TOKENS = 20


def _prompts(num: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(num)
    return [torch.randint(3, 2000, (int(n),), generator=gen).tolist() for n in torch.randint(1, 90, (num,))]


def _params(num: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        for i in range(num)
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("replay_window", [0, 4])
def test_graph_replay_gives_the_eager_tokens_at_every_batch_size(tiny_model_path, replay_window):
    # fp32: the same kernels and reduction order as eager, so tokens are exactly equal (a bf16 model's
    # greedy tokens may flip on a matmul's batch-size-dependent rounding, eager or not); with ReplaySSM
    # rings (window 4: folds every 4 tokens) the ring kernel's appends and folds replay too
    kwargs: dict[str, Any] = dict(
        dtype="float32",
        device="cuda",
        max_model_len=256,
        max_num_seqs=MAX_NUM_SEQS,
        replay_window=replay_window,
    )
    eager = LLM(str(tiny_model_path), enforce_eager=True, **kwargs)
    assert eager.engine.runner.graphs is None
    graphed = LLM(str(tiny_model_path), **kwargs)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None, "decode CUDA graphs were refused or failed to capture: see the log"
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    replays: list[int] = []
    run = graphs.run

    def counting(requests, size, *rest):  # type: ignore[no-untyped-def]
        replays.append(len(requests))
        return run(requests, size, *rest)

    graphs.run = counting  # type: ignore[method-assign]
    for num in range(1, MAX_NUM_SEQS + 1):
        prompts, params = _prompts(num), _params(num)
        want = [
            o.outputs[0].token_ids for o in eager.generate(prompt_token_ids=prompts, sampling_params=params)
        ]
        got = [
            o.outputs[0].token_ids for o in graphed.generate(prompt_token_ids=prompts, sampling_params=params)
        ]
        assert got == want, f"batch of {num}"
    assert set(replays) == set(range(1, MAX_NUM_SEQS + 1))  # every batch size replayed a graph


def test_failed_capture_leaves_the_runner_eager_and_unpadded(tiny_llm, caplog):
    engine = tiny_llm.engine
    padding = DecodePadding([1, 2], engine.plan.num_blocks, engine.plan.num_slots, use_graphs=True)
    with caplog.at_level(logging.ERROR, logger="splitserve.engine.model_runner"):
        runner = ModelRunner(
            engine.model,
            engine.caches,
            engine.sampler,
            engine.config.block_size,
            engine.device,
            padding,
            1024,
        )
    assert runner.graphs is None and runner.padding is None  # the CPU cannot capture: eager, as before
    assert "capturing decode CUDA graphs failed" in caplog.text
