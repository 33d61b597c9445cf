"""The product, end to end: `run_cluster` on local Ray (real actors, gRPC, HTTP), driven with the
official openai client. 32 concurrent mixed-length requests give the offline engine's tokens in
both modes, greedy and seeded; greedy tokens and top-5 logprobs agree with transformers' own
generate; streaming equals non-streaming; chat works; afterwards every worker and store is empty."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from deploy.launcher import run_cluster
from splitserve import LLM, SamplingParams
from splitserve.config import parse_config
from splitserve.tiny_model import make_tiny_model
from tests.e2e.helpers import MODEL, TOKEN_IDS, assert_idle, complete, openai_client, token_id, token_ids
from tests.oracle import GreedyTrace, check_logprobs_close, hf_greedy

NUM_REQUESTS = 32
NUM_ORACLE_TOKENS = 8


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("e2e-model"), seed=3)


@pytest.fixture(scope="module")
def workload(model_path):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randint(1, 200))] for _ in range(NUM_REQUESTS)]
    params = [
        {"max_tokens": rng.randint(1, 24), "temperature": 0.0}
        if i % 2 == 0
        else {"max_tokens": rng.randint(1, 24), "temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
        for i in range(NUM_REQUESTS)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def offline_tokens(model_path, workload):
    prompts, params = workload
    llm = LLM(model=str(model_path), max_model_len=4096)
    sps = [SamplingParams(ignore_eos=True, **p) for p in params]
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sps)]


@pytest.fixture(scope="module")
def oracle(model_path, workload) -> tuple[list[list[int]], list[GreedyTrace]]:
    """Four of the greedy requests' prompts and transformers' own greedy continuations of them."""
    prompts = workload[0][0:8:2]
    return prompts, hf_greedy(model_path, prompts, NUM_ORACLE_TOKENS)


def _config(model_path, mode: str):
    pools = {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB", "max_num_seqs": 32}
    data = {
        "model": {"path": str(model_path), "name": "tiny"},
        "mode": mode,
        "gateway": {"port": 0},
        "store": {"memory_bytes": "128MiB", "disk": {"path": None}},
        "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300},
    }
    if mode == "disaggregated":
        data["prefill"], data["decode"] = pools, pools
    else:  # the same two workers, each doing both (and each prefilling what it reserved)
        data["prefill"], data["decode"] = {**pools, "replicas": 2}, {"replicas": 0}
    return parse_config(data)


def _stream(client: openai.OpenAI, prompt: list[int], params: dict) -> tuple[list[int], str]:
    tokens, text = [], ""
    for event in client.completions.create(
        model=MODEL, prompt=prompt, logprobs=0, stream=True, extra_body=TOKEN_IDS, **params
    ):
        choice = event.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += token_ids(choice)
    return tokens, text


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def served(request, local_ray, model_path, workload):
    """The deployment of one mode, its client, and the tokens its 32 concurrent requests got."""
    prompts, params = workload
    with run_cluster(_config(model_path, request.param)) as cluster:
        client = openai_client(cluster.gateway_url)
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            tokens = list(pool.map(lambda a: complete(client, *a), zip(prompts, params)))
        yield request.param, cluster, client, tokens


def test_32_concurrent_requests_equal_the_offline_engine(served, offline_tokens):
    mode, _, _, tokens = served
    mismatched = [i for i, (got, want) in enumerate(zip(tokens, offline_tokens)) if got != want]
    assert not mismatched, f"{mode}: requests {mismatched} differ from the offline engine"


def test_streaming_equals_non_streaming(served, workload):
    _, _, client, tokens = served
    prompts, params = workload
    for i in (0, 1, 6, 7):
        streamed, text = _stream(client, prompts[i], params[i])
        whole = client.completions.create(
            model="tiny", prompt=prompts[i], extra_body={"ignore_eos": True}, **params[i]
        )
        assert streamed == tokens[i]
        assert text == whole.choices[0].text


def test_chat_completion_uses_the_tiny_template(served, model_path):
    _, _, client, _ = served
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, temperature=0
    )
    llm_text = (
        LLM(model=str(model_path), max_model_len=4096)
        .generate(
            prompt_token_ids=[_chat_ids(model_path)],
            sampling_params=SamplingParams(temperature=0, max_tokens=6),
        )[0]
        .outputs[0]
        .text
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == llm_text
    assert out.usage.completion_tokens >= 1


def _chat_ids(model_path) -> list[int]:
    from splitserve.tokenizer import Tokenizer

    tok = Tokenizer(model_path)
    return tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Say hi"}]), add_special_tokens=False
    )


def test_greedy_tokens_and_logprobs_agree_with_transformers(served, oracle):
    """The cluster against transformers' KimiLinearForCausalLM.generate, not only the offline engine:
    a divergence is allowed only where each side's token is in the other's top-5 (vLLM's rule)."""
    _, _, client, _ = served
    prompts, reference = oracle
    traces = []
    for prompt in prompts:
        out = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=NUM_ORACLE_TOKENS,
            temperature=0.0,
            logprobs=5,
            extra_body=TOKEN_IDS,
        )
        choice = out.choices[0]
        tops = [{token_id(t): lp for t, lp in top.items()} for top in choice.logprobs.top_logprobs]
        traces.append(GreedyTrace(token_ids(choice), tops))
    check_logprobs_close(reference, traces)


def test_every_worker_is_idle_and_the_store_empty_afterwards(served):
    """Per worker 0 running / waiting / reserved and every KV block and state slot free; 0 keys
    in every store (read from each worker's and store's own stats, not the controller's)."""
    mode, cluster, _, _ = served
    num_workers = sum(len(pool["workers"]) for pool in cluster.status()["pools"].values())
    assert num_workers == 2, f"{mode}: expected 2 workers, found {num_workers}"
    assert_idle(cluster)
