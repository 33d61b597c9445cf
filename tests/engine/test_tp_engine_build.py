"""What every rank of a tensor-parallel engine does as it is built (2 rank processes, gloo): the
warm-up that ends each rank's construction where kernels compile runs the same dummy steps on
every rank, meeting in the same collectives, and leaves every rank's caches as loaded; a CUDA
engine without fla is refused before any rank starts, and a rank's own build refuses it too."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine import llm_engine
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.ops import kda_dispatch
from splitserve.engine.ops.kda_dispatch import BACKEND_ENV
from splitserve.engine.parallel.commands import Command
from splitserve.engine.parallel.group import TensorParallel
from splitserve.engine.warm_up import warm_up_engine
from splitserve.engine_config import EngineConfig

SMALL = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4)


@dataclass(frozen=True)
class ForcedWarmUp(Command):
    """The warm-up a rank runs at the end of its construction on CUDA, forced on this CPU; the rank
    then checks it left its caches zero (a failure ends the rank, and the driver's next step with it)."""

    must_succeed = True

    def apply(self, engine: LLMEngine) -> None:
        warm_up_engine(engine, 0.0, force=True)
        assert _caches_all_zero(engine), f"rank {engine.tp.rank}'s warm-up left its caches dirty"


def _caches_all_zero(engine: LLMEngine) -> bool:
    caches = engine.caches
    tensors = [*caches.mla_kv.values(), *caches.kda_conv.values(), *caches.kda_recurrent.values()]
    return all(not t.any() for t in tensors)


def _tokens(llm: LLM) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (100, 9, 33)]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=6, ignore_eos=True),
    ]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [c.token_ids for o in outs for c in o.outputs]


def test_the_warm_up_on_every_rank_runs_in_step_and_leaves_the_caches_as_loaded(tiny_model_path):
    cold = LLM(str(tiny_model_path), **SMALL, tensor_parallel_size=2)
    try:
        assert cold.engine.warm_up.chunk_lengths == [], "a CPU engine skips it"
        want = _tokens(cold)
    finally:
        cold.shutdown()
    warm = LLM(str(tiny_model_path), **SMALL, tensor_parallel_size=2)
    try:
        engine = warm.engine
        assert engine.ranks is not None
        scheduler = engine.scheduler
        free_before = (list(scheduler.blocks._free), list(scheduler.slots._free))
        engine.ranks.send(ForcedWarmUp())  # as each rank runs it as it builds, where kernels compile
        report = warm_up_engine(engine, 0.0, force=True)
        assert report.chunk_lengths[0] == SMALL["max_num_batched_tokens"] and len(report.chunk_lengths) >= 6
        assert _caches_all_zero(engine)
        assert (list(scheduler.blocks._free), list(scheduler.slots._free)) == free_before
        assert _tokens(warm) == want  # and rank 1 found its shard of the caches zero (or it ended)
        assert [h.ended() for h in engine.ranks.handles] == [None]
    finally:
        warm.shutdown()


def test_cuda_without_fla_is_refused_before_any_rank_starts(monkeypatch, tiny_model_path):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(kda_dispatch, "fla_available", lambda: False)
    launched = []
    monkeypatch.setattr(llm_engine.Ranks, "launch", lambda *args: launched.append(args))
    config = EngineConfig(
        model=str(tiny_model_path), device="cuda", max_model_len=128, tensor_parallel_size=2
    )
    with pytest.raises(RuntimeError, match=r"needs flash-linear-attention.*splitserve\[gpu\]"):
        LLMEngine(config)
    assert launched == []


def test_a_rank_refuses_cuda_without_fla_before_its_weights_load(monkeypatch, tiny_model_path):
    """As a rank process builds its engine (its `tp` given, its own GPU)."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(kda_dispatch, "fla_available", lambda: False)
    loaded = []
    monkeypatch.setattr(llm_engine, "load_model", lambda *args: loaded.append(args))
    config = EngineConfig(
        model=str(tiny_model_path), device="cuda:1", max_model_len=128, tensor_parallel_size=2
    )
    with pytest.raises(RuntimeError, match=r"KDA on cuda:1 needs flash-linear-attention"):
        LLMEngine(config, tp=TensorParallel(rank=1, size=2))
    assert loaded == []
