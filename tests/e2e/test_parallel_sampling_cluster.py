"""`n` and `best_of` through the product: `run_cluster` on local Ray, the official openai client.

A seeded request with n=3 gives three choices equal to three separate requests seeded seed,
seed + 1, seed + 2 (vLLM's rule), from one prefill (the gateway sent one Prompt); usage counts
the prompt once. Streamed, every chunk names its choice and each choice finishes. Chat takes n
too; best_of returns the n of highest cumulative logprob. Both modes; nothing is left held.
"""

from __future__ import annotations

import random

import httpx
import pytest

from deploy.launcher import run_cluster
from splitserve import LLM, SamplingParams
from splitserve.tiny_model import make_tiny_model
from tests.e2e.helpers import (
    MODEL,
    TOKEN_IDS,
    assert_idle,
    cluster_config,
    openai_client,
    token_id,
    token_ids,
)

SEED = 900
PARAMS = {"max_tokens": 12, "temperature": 0.9, "top_p": 0.95}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("samples-e2e-model"), seed=3)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(8)
    return [rng.randrange(3, 2000) for _ in range(150)]


@pytest.fixture(scope="module")
def separate(model_path, prompt) -> list[list[int]]:
    """Four separate requests seeded SEED .. SEED + 3, from the offline engine, with logprobs."""
    llm = LLM(model=str(model_path), max_model_len=4096)
    params = [SamplingParams(ignore_eos=True, seed=SEED + i, logprobs=0, **PARAMS) for i in range(4)]
    return llm.generate(prompt_token_ids=[prompt] * 4, sampling_params=params)


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request, local_ray, model_path):
    with run_cluster(cluster_config(model_path, request.param)) as handle:
        yield handle


def _prompts_prefilled(url: str) -> float:
    """Prompt tokens the gateway has sent to be prefilled (one count per Prefill call)."""
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("splitserve_prefix_queried_tokens_total")
    )


def test_n_seeded_samples_equal_separate_requests_from_one_prefill(cluster, prompt, separate):
    client = openai_client(cluster.gateway_url)
    before = _prompts_prefilled(cluster.gateway_url)
    out = client.completions.create(
        model=MODEL, prompt=prompt, n=3, seed=SEED, logprobs=0, extra_body=TOKEN_IDS, **PARAMS
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [token_ids(c) for c in out.choices] == [s.outputs[0].token_ids for s in separate[:3]]
    assert len({tuple(token_ids(c)) for c in out.choices}) == 3
    assert out.usage.prompt_tokens == len(prompt)  # once, as OpenAI counts n
    assert out.usage.completion_tokens == 3 * PARAMS["max_tokens"]
    assert _prompts_prefilled(cluster.gateway_url) - before == len(prompt)  # one Prefill for the three
    assert_idle(cluster)


def test_streamed_samples_carry_their_choice_index(cluster, prompt, separate):
    client = openai_client(cluster.gateway_url)
    stream = client.completions.create(
        model=MODEL, prompt=prompt, n=3, seed=SEED, logprobs=0, stream=True, extra_body=TOKEN_IDS, **PARAMS
    )
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            assert choice.index not in finished, "a chunk after the choice finished"
            tokens[choice.index] += [token_id(t) for t in (choice.logprobs.tokens if choice.logprobs else [])]
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert [tokens[i] for i in range(3)] == [s.outputs[0].token_ids for s in separate[:3]]
    assert_idle(cluster)


def test_chat_takes_n(cluster):
    client = openai_client(cluster.gateway_url)
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], n=2, max_tokens=5, seed=SEED
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason for c in out.choices)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        n=2,
        max_tokens=5,
        seed=SEED,
        stream=True,
    )
    roles: dict[int, int] = {0: 0, 1: 0}
    texts: dict[int, str] = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            roles[choice.index] += choice.delta.role == "assistant"
            texts[choice.index] += choice.delta.content or ""
    assert roles == {0: 1, 1: 1}, "one role chunk per choice"
    assert texts == {c.index: c.message.content for c in out.choices}
    assert_idle(cluster)


def test_best_of_returns_the_most_likely_samples(cluster, prompt, separate):
    client = openai_client(cluster.gateway_url)
    out = client.completions.create(
        model=MODEL, prompt=prompt, n=2, best_of=4, seed=SEED, extra_body=TOKEN_IDS, **PARAMS
    )
    ranked = sorted(separate, key=lambda s: s.outputs[0].cumulative_logprob, reverse=True)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [s.outputs[0].text for s in ranked[:2]]
    assert ranked[0].outputs[0].text != ranked[1].outputs[0].text
    assert all(c.logprobs is None for c in out.choices), "logprobs were not asked for"
    assert out.usage.completion_tokens == 4 * PARAMS["max_tokens"]  # every sample drawn counts
    assert_idle(cluster)
