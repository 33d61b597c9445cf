"""`n` through the real gateway against fake workers: one Reserve (room for every sample), one
Prefill, one Decode naming every sample's first token, n choices with their indexes; a stop
string ends one sample here (that sample is aborted alone, or marked before the Decode); usage
counts the prompt once; a client that leaves frees everything."""

from __future__ import annotations

import json

from tests.frontend.conftest import MODEL, SCRIPT_TEXT, Gateway


def test_n_choices_share_one_reserve_prefill_and_decode(gateway: Gateway, tokenizer):
    result = gateway.openai().completions.create(model=MODEL, prompt="Say hello", max_tokens=50, n=3, seed=7)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert all(c.text == SCRIPT_TEXT and c.finish_reason == "stop" for c in result.choices)
    prompt_ids = tokenizer.encode("Say hello")
    num_script = len(gateway.prefill.script.token_ids)
    assert result.usage.prompt_tokens == len(prompt_ids)  # once for the three
    assert result.usage.completion_tokens == 3 * (num_script + 1)
    (reserve,) = gateway.decode.reserves
    (prefill,) = gateway.prefill.requests
    (decode,) = gateway.decode.decodes
    assert reserve.num_samples == 3 and prefill.sampling_params.n == 3 and prefill.sampling_params.seed == 7
    assert decode.request_id == reserve.request_id == prefill.request_id
    assert [s.token_id for s in decode.samples] == [gateway.prefill.script.token_ids[0]] * 3
    assert gateway.decode.aborts == []


def test_streamed_choices_carry_their_index_and_end_alone(gateway: Gateway):
    body = {"model": MODEL, "prompt": "Say hello", "max_tokens": 50, "n": 2, "stream": True}
    with gateway.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        assert choice["index"] not in finishes
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: SCRIPT_TEXT, 1: SCRIPT_TEXT} and finishes == {0: "stop", 1: "stop"}


def test_a_stop_string_on_a_first_token_keeps_that_sample_out_of_the_decode(gateway: Gateway, tokenizer):
    first_text = tokenizer.decode(gateway.prefill.script.token_ids[:1])
    result = gateway.openai().completions.create(
        model=MODEL, prompt="Say hello", max_tokens=50, n=2, stop=[first_text]
    )
    assert [c.finish_reason for c in result.choices] == ["stop", "stop"]
    assert gateway.decode.decodes == [], "every sample ended on its first token: no Decode"
    assert gateway.decode.aborts == [gateway.decode.reserves[0].request_id]  # the room, given back


def test_a_stop_string_mid_stream_aborts_that_sample_alone(gateway: Gateway, tokenizer):
    script = gateway.prefill.script.token_ids
    stop = tokenizer.decode(script[3:4])
    result = gateway.openai().completions.create(
        model=MODEL, prompt="Say hello", max_tokens=50, n=2, stop=[stop]
    )
    assert [c.finish_reason for c in result.choices] == ["stop", "stop"]
    assert gateway.decode.wait_for_aborts(2)
    rid = gateway.decode.reserves[0].request_id
    assert sorted(gateway.decode.aborts) == [f"0_{rid}", f"1_{rid}"]  # each sample by its own id


def test_best_of_is_refused_when_streamed_and_needs_n_or_more(gateway: Gateway):
    with gateway.http() as http:
        streamed = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 1, "best_of": 2, "stream": True}
        )
        fewer = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 3, "best_of": 2})
    assert streamed.status_code == 400 and "cannot be streamed" in streamed.json()["error"]["message"]
    assert fewer.status_code == 400 and fewer.json()["error"]["param"] == "best_of"
    assert gateway.decode.reserves == [] and gateway.prefill.requests == []
