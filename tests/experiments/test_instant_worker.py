"""The instant worker behind the real gateway: max_tokens, EOS, prompt-derived tokens, store Stats."""

from __future__ import annotations

import time

import httpx

from experiments.instant_worker import output_token
from splitserve.tokenizer import Tokenizer
from tests.experiments.conftest import MODEL, InstantGateway

PROMPT = "The quick brown fox jumps over the lazy dog."


def test_max_tokens_is_honoured_through_the_gateway(instant_gateway: InstantGateway) -> None:
    out = instant_gateway.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert out.usage is not None and out.usage.completion_tokens == 5
    assert out.choices[0].finish_reason == "length"


def test_a_single_token_needs_no_decode(instant_gateway: InstantGateway) -> None:
    out = instant_gateway.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert out.usage is not None and out.usage.completion_tokens == 1
    assert out.choices[0].finish_reason == "length"


def test_streamed_tokens_are_the_prompt_cycled(instant_gateway: InstantGateway, tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    expected = [output_token(prompt_ids, i) for i in range(2 * len(prompt_ids) + 3)]
    stream = instant_gateway.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=len(expected), stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(expected)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_eos_ends_the_request_unless_ignored(instant_gateway: InstantGateway, tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id("<|im_end|>")
    assert eos is not None
    prompt = [40, 41, eos, 42]
    stopped = instant_gateway.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == 3
    ignored = instant_gateway.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage is not None and ignored.usage.completion_tokens == 8


def test_the_gateway_reads_the_worker_as_its_state_store(instant_gateway: InstantGateway) -> None:
    instant_gateway.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    gauge = f'splitserve_store_capacity_bytes{{store="{instant_gateway.worker_address}",tier="memory"}}'
    deadline_s = time.monotonic() + 10.0
    while time.monotonic() < deadline_s:
        if gauge in httpx.get(f"{instant_gateway.url}/metrics", timeout=10).text:
            return
        time.sleep(0.1)
    raise AssertionError(f"{gauge} never appeared in the gateway's /metrics")
