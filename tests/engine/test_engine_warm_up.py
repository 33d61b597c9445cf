"""The engine's warm-up at load (engine/warm_up.py): on the CUDA code path (kernels stubbed, counted on
the CPU) it launches every kernel a decode step and a prefill chunk launch, so a request afterwards
needs no specialisation it did not compile; what it runs leaves every cache zero and every allocator
as it was, so tokens do not change; a CPU engine skips it; the kernel caches go under splitserve's."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine import warm_up
from splitserve.engine.warm_up import use_kernel_caches, warm_up_engine

pytest.importorskip("triton")  # the kernels' Python wrappers import it

from experiments import decode_launches, prefill_launches  # noqa: E402
from experiments.launch_counter import LaunchCounter, cuda_code_path  # noqa: E402
from experiments.prefill_launches import compile_key  # noqa: E402

SMALL = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (100, 9, 33)]


def _tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=_prompts(), sampling_params=params)]


def _caches_all_zero(llm: LLM) -> bool:
    caches = llm.engine.caches
    tensors = [*caches.mla_kv.values(), *caches.kda_conv.values(), *caches.kda_recurrent.values()]
    return all(not t.any() for t in tensors)


def test_a_cpu_engine_skips_the_warm_up_even_with_kernels_forced(tiny_llm, monkeypatch):
    report = tiny_llm.engine.warm_up
    assert report.chunk_lengths == [] and report.decode_kernels == [] and report.prefill_s == 0.0
    with cuda_code_path(LaunchCounter()):  # interpreted or stubbed kernels compile nothing
        assert not warm_up.kernels_compile(torch.device("cpu"))
        assert warm_up.kernels_compile(torch.device("cuda"))


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"enable_prefix_caching": True, "prefix_unit": 16},
        {"pad_decode_batches": True},
        {"replay_window": 4},
    ],
    ids=["plain", "prefix-caching", "padded-decode", "replay-ssm"],
)
def test_the_warm_up_leaves_caches_and_allocators_as_loaded_and_tokens_unchanged(tiny_model_path, extra):
    # greedy, seeded, and unseeded (drawn from the engine's own generator: the warm-up must not draw)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    params = [GREEDY, seeded, SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True)]
    cold = LLM(str(tiny_model_path), **SMALL, **extra)
    want = _tokens(cold, params)
    warm = LLM(str(tiny_model_path), **SMALL, **extra)
    scheduler = warm.engine.scheduler
    free_before = (list(scheduler.blocks._free), list(scheduler.slots._free))
    report = warm_up_engine(warm.engine, 0.0, force=True)  # the torch path: every row computed for real
    assert report.chunk_lengths[0] == SMALL["max_num_batched_tokens"] and len(report.chunk_lengths) >= 6
    assert _caches_all_zero(warm)
    assert (list(scheduler.blocks._free), list(scheduler.slots._free)) == free_before
    assert _tokens(warm, params) == want


def _build_on_the_cuda_code_path(path: Any, counter: LaunchCounter, monkeypatch: pytest.MonkeyPatch) -> LLM:
    """An engine whose every kernel is stubbed (counted), built as on CUDA, where kernels compile."""
    monkeypatch.setattr(warm_up, "kernels_compile", lambda device: True)
    with cuda_code_path(counter):
        return LLM(str(path), **SMALL, cuda_graph_batch_sizes=(1, 2, 4))


def test_the_warm_up_launches_every_kernel_of_a_decode_step_and_a_prefill_chunk(
    tiny_model_path, caplog, monkeypatch
):
    counter = LaunchCounter()
    with caplog.at_level(logging.INFO, logger=warm_up.__name__):
        llm = _build_on_the_cuda_code_path(tiny_model_path, counter, monkeypatch)
    report = llm.engine.warm_up
    assert report.decode_batch_sizes == [1, 2, 4]
    assert len(report.decode_kernels) == 5 * 3  # norms, KDA gates, router, MLA, MoE per batch size
    config = decode_launches.model_config("tiny")
    wanted = {launch.kernel.name for launch in decode_launches.count_decode_step(config, 2, 40).launched}
    wanted |= {launch.kernel.name for launch in prefill_launches.count_prefill_chunk(config, 40, 48).launched}
    warmed = {launch.kernel.name for launch in counter.launched}
    assert wanted <= warmed, wanted - warmed
    assert {name for name, _ in counter.fla_calls} == {"chunk_kda", "fused_recurrent_kda_fwd"}
    (line,) = [r.getMessage() for r in caplog.records if r.name == warm_up.__name__]
    for part in ("weights and caches", "decode CUDA graphs", "decode kernels", "prefill kernels"):
        assert part in line, line


def test_a_long_prompt_and_its_decode_after_the_warm_up_compile_nothing_new(tiny_model_path, monkeypatch):
    counter = LaunchCounter()
    llm = _build_on_the_cuda_code_path(tiny_model_path, counter, monkeypatch)
    warmed = {compile_key(launch) for launch in counter.launched}
    tuned = set(counter.fla_calls)
    counter.launched.clear()
    counter.fla_calls.clear()
    gen = torch.Generator().manual_seed(1)
    # a prompt of three full chunks and an odd tail, then decodes beside a short prompt's chunk
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (3 * 64 - 7, 5)]
    with cuda_code_path(counter):
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=8))
    assert len(counter.launched) > 100
    new = {compile_key(launch) for launch in counter.launched} - warmed
    assert not new, f"compiled inside the request: {sorted(new, key=str)}"
    assert set(counter.fla_calls) <= tuned


def test_kernel_caches_go_under_splitserves_cache_dir_unless_set(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # so that the undo removes what the call sets
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")  # the user's choice stays
    assert use_kernel_caches(torch.device("cpu")) == {}  # nothing compiles on a CPU
    assert use_kernel_caches(torch.device("cuda")) == {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"
