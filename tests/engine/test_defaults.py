"""What `LLM(model=DIR)` gets with nothing else: a KV budget sized from what it needs, and a
max_model_len that budget holds, even on a checkpoint saved with transformers' 1M-token context."""

from __future__ import annotations

import logging

import pytest
from transformers import KimiLinearConfig

from splitserve import LLM, SamplingParams
from splitserve.engine.cache_budget import CPU_KV_CACHE_MAX_BYTES
from splitserve.engine.cache_spec import CachePlan
from splitserve.tiny_model import make_tiny_model

TRANSFORMERS_CONTEXT = KimiLinearConfig().max_position_embeddings  # what save_pretrained writes by default


@pytest.fixture(scope="module")
def long_context_path(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("long-context"), max_position_embeddings=TRANSFORMERS_CONTEXT
    )


def test_llm_with_only_a_model_generates_on_a_long_context_checkpoint(long_context_path, caplog):
    with caplog.at_level(logging.INFO, logger="splitserve.engine.llm_engine"):
        llm = LLM(model=str(long_context_path))
    engine = llm.engine
    assert engine.model_config.max_position_embeddings == TRANSFORMERS_CONTEXT == 2**20
    assert engine.plan.total_bytes <= CPU_KV_CACHE_MAX_BYTES  # the CPU default's cap holds ...
    assert engine.max_model_len == engine.plan.max_tokens_per_request < TRANSFORMERS_CONTEXT  # ... this much
    assert f"max_model_len not given: using {engine.max_model_len:,} tokens" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate(prompts=["Hello, my name is"], sampling_params=params)
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].finish_reason == "length"


def test_an_explicit_max_model_len_that_does_not_fit_is_an_error(long_context_path):
    path = str(long_context_path)
    with pytest.raises(ValueError, match="max_model_len=1,048,577 exceeds the model's context"):
        LLM(model=path, max_model_len=TRANSFORMERS_CONTEXT + 1)
    with pytest.raises(
        ValueError, match=r"kv_cache_memory_bytes=16,777,216 is too small: .* one request of 1,000,000 tokens"
    ):
        LLM(model=path, max_model_len=1_000_000, kv_cache_memory_bytes=16 * 2**20)
    with pytest.raises(ValueError, match=r"is too small: .*kv_cache_memory_bytes not given, so the default"):
        LLM(model=path, max_model_len=TRANSFORMERS_CONTEXT)


def test_a_given_budget_sets_the_chosen_length(long_context_path):
    llm = LLM(model=str(long_context_path), kv_cache_memory_bytes=8 * 2**20, max_num_seqs=4)
    unit = CachePlan.specs(llm.engine.model_config, block_size=16, dtype="float32")
    num_blocks = (8 * 2**20 - 4 * unit.slot_bytes) // unit.block_bytes
    assert llm.engine.plan.num_blocks == num_blocks
    assert llm.engine.max_model_len == num_blocks * 16


def test_the_default_budget_is_what_full_length_requests_need(tiny_model_path):
    llm = LLM(model=str(tiny_model_path), max_num_seqs=8)
    context = llm.engine.model_config.max_position_embeddings
    assert llm.engine.max_model_len == context  # the checkpoint's own: the budget is sized for it
    assert llm.engine.plan.num_slots == 8 and llm.engine.plan.num_blocks == 8 * context // 16


def test_on_cuda_the_default_leaves_a_tenth_of_the_device_to_activations(long_context_path, monkeypatch):
    import torch

    from splitserve.engine.cache_budget import default_kv_cache_bytes
    from splitserve.engine.model_config import KimiLinearModelConfig
    from splitserve.engine_config import EngineConfig

    model = KimiLinearModelConfig.from_pretrained(long_context_path)
    config = EngineConfig(model=str(long_context_path), device="cuda")
    total = 100 * 2**30
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)  # no GPU here: only the arithmetic
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * 2**30, total))
    budget, why = default_kv_cache_bytes(model, config, torch.device("cuda"))
    assert budget == 30 * 2**30 - total // 10 and "GPU memory left after the weights" in why
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * 2**30, total))
    with pytest.raises(ValueError, match="no GPU memory is left for the KV cache"):
        default_kv_cache_bytes(model, config, torch.device("cuda"))
