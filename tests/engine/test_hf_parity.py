"""Greedy tokens and top-5 logprobs equal transformers' generate, judged like vLLM's
check_logprobs_close, across checkpoint shapes and with chunked prefill and preemption forced."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.tiny_model import make_tiny_model
from tests.oracle import check_logprobs_close, engine_traces, hf_greedy, hf_logits

KDA, MLA = "linear_attention", "full_attention"
NUM_NEW_TOKENS = 8
PROMPT_LENGTHS = [1, 5, 17, 64, 129, 333]

CHECKPOINTS = {
    "mla-late-no-qlora-k4": dict(
        num_hidden_layers=4,
        layer_types=[KDA, KDA, KDA, MLA],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        q_lora_rank=None,
        linear_conv_kernel_dim=4,
        n_group=2,
        topk_group=1,
    ),
    "mla-early-qlora-k3": dict(
        num_hidden_layers=4,
        layer_types=[MLA, KDA, MLA, KDA],
        mlp_layer_types=["sparse", "dense", "sparse", "sparse"],
        q_lora_rank=24,
        linear_conv_kernel_dim=3,
        n_group=1,
        topk_group=1,
    ),
    "grouped-routing-k2": dict(
        num_hidden_layers=5,
        layer_types=[KDA, MLA, KDA, KDA, MLA],
        mlp_layer_types=["dense"] + ["sparse"] * 4,
        q_lora_rank=16,
        linear_conv_kernel_dim=2,
        n_group=4,
        topk_group=2,
    ),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    path = make_tiny_model(
        tmp_path_factory.mktemp(request.param), seed=len(request.param), **CHECKPOINTS[request.param]
    )
    vocab = KimiLinearModelConfig.from_pretrained(path).vocab_size
    rng = random.Random(7)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    return path, prompts, hf_greedy(path, prompts, NUM_NEW_TOKENS)


def _greedy(**_: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)


def _run(path, prompts, **engine_kwargs):
    llm = LLM(model=str(path), dtype="float32", **engine_kwargs)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_greedy())
    return llm, engine_traces(outs)


def test_greedy_matches_transformers_with_engine_defaults(checkpoint):
    path, prompts, reference = checkpoint
    _, traces = _run(path, prompts)
    check_logprobs_close(reference, traces)


def test_greedy_matches_transformers_with_chunked_prefill(checkpoint):
    path, prompts, reference = checkpoint
    llm, traces = _run(path, prompts, max_num_batched_tokens=24, max_num_seqs=4)
    check_logprobs_close(reference, traces)


def test_greedy_matches_transformers_under_preemption(checkpoint):
    path, prompts, reference = checkpoint
    config = KimiLinearModelConfig.from_pretrained(path)
    max_model_len, block_size, max_num_seqs = 400, 16, 8
    unit = CachePlan.specs(config, block_size=block_size, dtype="float32")
    num_blocks = -(-max_model_len // block_size) + 2  # one longest request fits, all of them do not
    budget = max_num_seqs * unit.slot_bytes + num_blocks * unit.block_bytes
    llm, traces = _run(
        path,
        prompts,
        kv_cache_memory_bytes=budget,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
    )
    assert llm.engine.plan.num_blocks == num_blocks
    assert llm.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    check_logprobs_close(reference, traces)


def test_full_forward_logits_match_transformers_to_1e_4(checkpoint):
    path, prompts, _ = checkpoint
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=48)
    for prompt in (prompts[3], prompts[5]):
        expected = hf_logits(path, prompt)
        got = llm.engine.prompt_logits(prompt)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
