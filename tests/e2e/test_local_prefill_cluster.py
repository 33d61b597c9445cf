"""Conditional disaggregation through the product (`router.local_prefill_max_tokens`): a
conversation's first turn goes to the prefill worker; each next turn re-sends it with the reply
and a few new tokens, and the decode worker that kept the history computes it itself. Every
turn's tokens, greedy and seeded, equal the offline engine's with caching off, and the gateway
counts the turns its decode worker prefilled."""

from __future__ import annotations

import random

import httpx
import pytest

from deploy.launcher import run_cluster
from splitserve import LLM, SamplingParams
from splitserve.config import parse_config
from splitserve.tiny_model import make_tiny_model
from tests.e2e.helpers import MODEL, TOKEN_IDS, openai_client, token_ids

PREFIX_UNIT = 32
LOCAL_LIMIT = 64  # each later turn adds the reply and 40 tokens: within it; the first turn is not
GREEDY = {"max_tokens": 8, "temperature": 0.0}
SEEDED = {"max_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": 11}
NUM_TURNS = 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("local-prefill-model"), seed=6)


@pytest.fixture(scope="module")
def user_parts() -> list[list[int]]:
    """What the user adds each turn: 270 tokens, then 40 at a time."""
    rng = random.Random(21)
    return [[rng.randrange(3, 2000) for _ in range(270 if turn == 0 else 40)] for turn in range(NUM_TURNS)]


def _conversation(generate, user_parts: list[list[int]]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Each turn's reply, every turn re-sending the history: `generate(prompt)` -> reply ids."""
    history: list[int] = []
    replies = []
    for part in user_parts:
        history = history + part
        replies.append(generate(history))
        history = history + replies[-1]
    return replies


@pytest.fixture(scope="module")
def offline(model_path, user_parts) -> dict[str, list[list[int]]]:
    llm = LLM(model=str(model_path), max_model_len=4096)

    def generate_with(params: dict):  # type: ignore[no-untyped-def]
        sp = SamplingParams(ignore_eos=True, **params)
        return lambda prompt: (
            llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0].outputs[0].token_ids
        )

    return {
        name: _conversation(generate_with(p), user_parts)
        for name, p in (("greedy", GREEDY), ("seeded", SEEDED))
    }


@pytest.fixture(scope="module")
def gateway_url(local_ray, model_path):
    pools = {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB", "max_num_seqs": 8}
    config = parse_config(
        {
            "model": {"path": str(model_path), "name": MODEL},
            "gateway": {"port": 0},
            "prefill": pools,
            "decode": pools,
            "store": {"memory_bytes": "128MiB", "disk": {"path": None}},
            "cache": {"prefix_unit": PREFIX_UNIT},
            "router": {"local_prefill_max_tokens": LOCAL_LIMIT},
            "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300},
        }
    )
    with run_cluster(config) as cluster:
        yield cluster.gateway_url


def _local_prefills_served(gateway_url: str) -> float:
    text = httpx.get(f"{gateway_url}/metrics", timeout=30).text
    series = f'splitserve_local_prefills_total{{model_name="{MODEL}",outcome="served"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(series))


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_later_turns_are_prefilled_by_the_decode_worker_and_equal_offline(
    gateway_url, user_parts, offline, sampling
) -> None:
    client = openai_client(gateway_url)
    params = GREEDY if sampling == "greedy" else SEEDED
    cached: list[int] = []

    def generate(prompt: list[int]) -> list[int]:
        out = client.completions.create(
            model=MODEL, prompt=prompt, logprobs=0, extra_body=TOKEN_IDS, **params
        )
        details = out.usage.prompt_tokens_details
        cached.append((details.cached_tokens or 0) if details is not None else 0)
        return token_ids(out.choices[0])

    served_before = _local_prefills_served(gateway_url)
    replies = _conversation(generate, user_parts)
    assert replies == offline[sampling]
    assert _local_prefills_served(gateway_url) - served_before == NUM_TURNS - 1
    # each later turn started from the previous turn's whole history but its last token
    history = 0
    for turn in range(1, NUM_TURNS):
        history += len(user_parts[turn - 1]) + len(replies[turn - 1])
        assert cached[turn] == history - 1, f"turn {turn + 1} cached {cached[turn]} of {history} tokens"


def test_a_short_prompt_is_prefilled_by_a_decode_worker(gateway_url) -> None:
    """A prompt no longer than the limit skips the handoff even when nothing of it is cached."""
    client = openai_client(gateway_url)
    served_before = _local_prefills_served(gateway_url)
    prompt = list(range(100, 100 + LOCAL_LIMIT))
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=TOKEN_IDS)
    assert out.usage.completion_tokens == 2
    assert _local_prefills_served(gateway_url) - served_before == 1
