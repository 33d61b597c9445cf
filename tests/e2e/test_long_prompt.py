"""A 16k-token prompt through a real deployment (`run_cluster` on local Ray, the `tiny-long` model):
its greedy tokens equal the offline engine's, and the state handed from prefill to decode is that
prompt's (every MLA layer's KV rows, which grow with it). experiments/long_prompt.py runs 8k-32k."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from deploy.launcher import run_cluster
from splitserve import LLM, SamplingParams
from splitserve.config import parse_config
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.tiny_model import PRESETS, make_tiny_model
from tests.e2e.helpers import complete

NUM_PROMPT_TOKENS = 16384
MAX_MODEL_LEN = NUM_PROMPT_TOKENS + 1024
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("long-prompt-model"), preset="tiny-long", seed=3)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(16)
    return [rng.randrange(3, 2000) for _ in range(NUM_PROMPT_TOKENS)]


def test_the_tiny_long_preset_is_tiny_with_a_64k_context(model_path) -> None:
    config = KimiLinearModelConfig.from_pretrained(model_path)
    assert config.max_position_embeddings == 65536
    assert {k: v for k, v in PRESETS["tiny-long"].items() if k != "max_position_embeddings"} == {
        k: v for k, v in PRESETS["tiny"].items() if k != "max_position_embeddings"
    }


def test_a_16k_token_prompt_through_a_cluster_equals_the_offline_engine(
    local_ray, model_path, prompt
) -> None:
    config = parse_config(
        {
            "model": {"path": str(model_path), "name": "tiny", "max_model_len": MAX_MODEL_LEN},
            "gateway": {"port": 0},
            "store": {"memory_bytes": "256MiB", "disk": {"path": None}},
            # health.timeout_s, store.lease_s and the gateway's reserve timeout stay the defaults:
            # a long prompt's prefill chunks and its whole prefill must fit them
            "health": {"interval_s": 1, "start_timeout_s": 300},
        }
    )
    with run_cluster(config) as cluster:
        assert cluster.gateway_url is not None
        # a 16k prefill took 21 s alone here and over 60 s loaded: the helper client allows only 120 s
        client = openai.OpenAI(
            base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0, timeout=900
        )
        tokens = complete(client, prompt, {"max_tokens": MAX_TOKENS, "temperature": 0})
        metrics = httpx.get(f"{cluster.gateway_url}/metrics", timeout=30).text
    moved = [line for line in metrics.splitlines() if line.startswith("splitserve_state_transfer_bytes_sum")]
    # 2 MLA layers x (kv_lora_rank 32 + rope 16) fp32 per prompt token, at least
    assert moved and float(moved[0].rsplit(" ", 1)[1]) >= NUM_PROMPT_TOKENS * 2 * 48 * 4
    llm = LLM(model=str(model_path), max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    assert len(tokens) == MAX_TOKENS
    assert tokens == expected
