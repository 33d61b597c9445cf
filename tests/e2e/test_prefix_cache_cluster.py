"""Prefix caching through the product: `run_cluster` on local Ray, the official openai client.

A conversation's next turn re-sends the previous prompt and more: with caching on (the
default), the second request reports `usage.prompt_tokens_details.cached_tokens > 0` and its
tokens, greedy and seeded, equal the offline engine's with caching off. Both modes: the
colocated worker reports its cached tokens too."""

from __future__ import annotations

import random

import openai
import pytest

from deploy.launcher import run_cluster
from splitserve import LLM, SamplingParams
from splitserve.tiny_model import make_tiny_model
from tests.e2e.helpers import MODEL, TOKEN_IDS, cluster_config, openai_client, token_ids

PREFIX_UNIT = 32
GREEDY = {"max_tokens": 8, "temperature": 0.0}
SEEDED = {"max_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": 7}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("prefix-e2e-model"), seed=5)


@pytest.fixture(scope="module")
def turns() -> list[list[int]]:
    """Two turns of one conversation: the second re-sends the first (270 tokens, ending inside a
    prefix unit) and adds 40 more."""
    rng = random.Random(12)
    first = [rng.randrange(3, 2000) for _ in range(270)]
    return [first, first + [rng.randrange(3, 2000) for _ in range(40)]]


@pytest.fixture(scope="module")
def repeated() -> dict[str, list[int]]:
    """One prompt per sampling mode (270 tokens, ending inside a prefix unit), sent twice."""
    rngs = {"greedy": random.Random(21), "seeded": random.Random(22)}
    return {name: [rng.randrange(3, 2000) for _ in range(270)] for name, rng in rngs.items()}


@pytest.fixture(scope="module")
def offline(model_path, turns, repeated) -> dict[str, list[list[int]]]:
    """Each turn's tokens from the offline engine with prefix caching off, greedy and seeded,
    then the repeated prompt's."""
    llm = LLM(model=str(model_path), max_model_len=4096)
    out = {}
    for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        sp = SamplingParams(ignore_eos=True, **params)
        prompts = [*turns, repeated[name]]
        out[name] = [
            o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        ]
    return out


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def client(request, local_ray, model_path):
    config = cluster_config(model_path, request.param, cache={"prefix_unit": PREFIX_UNIT})
    with run_cluster(config) as cluster:
        yield openai_client(cluster.gateway_url)


def _complete(client: openai.OpenAI, prompt: list[int], params: dict) -> tuple[list[int], int]:
    """One completion's token ids and its cached prompt tokens."""
    out = client.completions.create(model=MODEL, prompt=prompt, logprobs=0, extra_body=TOKEN_IDS, **params)
    details = out.usage.prompt_tokens_details
    return token_ids(out.choices[0]), (details.cached_tokens or 0) if details is not None else 0


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_the_next_turn_hits_the_cache_and_equals_caching_off(client, turns, offline, sampling):
    params = GREEDY if sampling == "greedy" else SEEDED
    first, first_cached = _complete(client, turns[0], params)
    second, second_cached = _complete(client, turns[1], params)
    assert [first, second] == offline[sampling][:2]
    # the first turn's prompt at least (or, once the other sampling ran on this cluster, the
    # second turn's own last unit before its end); never its last token, which a sample needs
    assert 0 < second_cached < len(turns[1]), f"cached {second_cached} of the second turn's prompt"
    assert first_cached <= len(turns[0])


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_the_same_prompt_again_hits_the_last_unit_before_its_end(client, repeated, offline, sampling):
    """A retry of a prompt is served from the snapshot at its last whole unit before its last
    token (the prompt-end one cannot serve it: a sample needs that token computed)."""
    params = GREEDY if sampling == "greedy" else SEEDED
    prompt = repeated[sampling]
    first, first_cached = _complete(client, prompt, params)
    again, again_cached = _complete(client, prompt, params)
    assert first_cached == 0
    assert again_cached == (len(prompt) - 1) // PREFIX_UNIT * PREFIX_UNIT == 256
    assert first == again == offline[sampling][2]
