"""Completions and chat through the real gateway, against fake workers, with the openai client."""

from __future__ import annotations

import json

from tests.frontend.conftest import MODEL, SCRIPT_TEXT, Gateway
from tests.frontend.fakes import EOS_TOKEN_ID, STORE_ADDRESS


def _sse_events(gateway: Gateway, path: str, body: dict) -> list[str]:
    with gateway.http() as http, http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_text_completion_runs_reserve_prefill_decode_and_returns_the_script(gateway: Gateway, tokenizer):
    result = gateway.openai().completions.create(model=MODEL, prompt="Say hello", max_tokens=50)
    choice = result.choices[0]
    assert choice.text == SCRIPT_TEXT
    assert choice.finish_reason == "stop"  # the fake ends the script with EOS
    prompt_ids = tokenizer.encode("Say hello")
    num_script = len(gateway.prefill.script.token_ids)
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == num_script + 1  # the EOS counts, its text does not show
    assert result.usage.total_tokens == len(prompt_ids) + num_script + 1

    (reserve,) = gateway.decode.reserves
    (prefill,) = gateway.prefill.requests
    (decode,) = gateway.decode.decodes
    assert reserve.num_prompt_tokens == len(prompt_ids) and reserve.max_tokens == 50
    assert list(prefill.prompt_token_ids) == prompt_ids
    assert prefill.request_id == reserve.request_id == decode.request_id
    assert prefill.store_address == STORE_ADDRESS
    assert prefill.state_key == f"state-{reserve.request_id}"
    assert prefill.state_owner == f"owner-{reserve.request_id}"
    assert decode.first_token_id == gateway.prefill.script.token_ids[0]
    assert decode.state.key == prefill.state_key and decode.state.store_address == STORE_ADDRESS
    assert list(decode.prompt_token_ids) == prompt_ids
    assert decode.sampling_params.max_tokens == 50
    assert gateway.decode.aborts == []  # finished normally: nothing to abort


def test_max_tokens_cuts_with_length(gateway: Gateway, tokenizer):
    result = gateway.openai().completions.create(model=MODEL, prompt="Say hello", max_tokens=4)
    script = gateway.prefill.script.token_ids
    assert result.choices[0].finish_reason == "length"
    assert result.choices[0].text == tokenizer.decode(script[:4])
    assert result.usage.completion_tokens == 4


def test_token_id_prompt_is_sent_as_given(gateway: Gateway):
    result = gateway.openai().completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3)
    assert list(gateway.prefill.requests[0].prompt_token_ids) == [5, 6, 7, 8]
    assert result.usage.prompt_tokens == 4


def test_list_of_prompts_gives_one_choice_each_in_order(gateway: Gateway, tokenizer):
    prompts = ["first prompt", "a second, longer prompt", "third"]
    result = gateway.openai().completions.create(model=MODEL, prompt=prompts, max_tokens=5)
    assert [c.index for c in result.choices] == [0, 1, 2]
    expected = tokenizer.decode(gateway.prefill.script.token_ids[:5])
    assert all(c.text == expected for c in result.choices)
    sent = sorted(list(r.prompt_token_ids) for r in gateway.prefill.requests)
    assert sent == sorted(tokenizer.encode(p) for p in prompts)
    assert len({r.request_id for r in gateway.prefill.requests}) == 3
    assert result.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert result.usage.completion_tokens == 15


def test_list_of_token_id_prompts_streams_every_choice(gateway: Gateway, tokenizer):
    chunks = list(
        gateway.openai().completions.create(
            model=MODEL, prompt=[[5, 6], [7, 8, 9]], max_tokens=6, stream=True
        )
    )
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    expected = tokenizer.decode(gateway.prefill.script.token_ids[:6])
    assert texts == {0: expected, 1: expected}
    assert finishes == {0: "length", 1: "length"}


def test_chat_renders_the_template_and_returns_an_assistant_message(gateway: Gateway, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    result = gateway.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=50)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == SCRIPT_TEXT
    assert result.choices[0].finish_reason == "stop"
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected_ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert list(gateway.prefill.requests[0].prompt_token_ids) == expected_ids
    assert result.usage.prompt_tokens == len(expected_ids)


def test_chat_without_max_tokens_reserves_the_rest_of_the_context(gateway: Gateway):
    gateway.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    reserve = gateway.decode.reserves[0]
    assert reserve.max_tokens == gateway.settings.max_model_len - reserve.num_prompt_tokens


def test_streamed_completion_equals_the_whole_one(gateway: Gateway):
    client = gateway.openai()
    whole = client.completions.create(model=MODEL, prompt="Say hello", max_tokens=50, logprobs=2)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Say hello",
            max_tokens=50,
            logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text == SCRIPT_TEXT
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "stop"
    streamed_tokens = [t for c in text_chunks for t in c.choices[0].logprobs.tokens]
    assert streamed_tokens == whole.choices[0].logprobs.tokens
    streamed_offsets = [t for c in text_chunks for t in c.choices[0].logprobs.text_offset]
    assert streamed_offsets == whole.choices[0].logprobs.text_offset
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_streamed_chat_equals_the_whole_one_and_ends_with_done(gateway: Gateway):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50}
    whole = gateway.openai().chat.completions.create(**body)
    events = _sse_events(gateway, "/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == whole.choices[0].message.content == SCRIPT_TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["usage"] is None for c in chunks)  # not asked for


def test_stop_string_cuts_the_text_and_aborts_the_decode_stream(gateway: Gateway):
    result = gateway.openai().completions.create(model=MODEL, prompt="Say hello", max_tokens=50, stop=["fox"])
    choice = result.choices[0]
    assert choice.text == SCRIPT_TEXT[: SCRIPT_TEXT.index("fox")]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "fox"
    assert gateway.decode.aborted.wait(5)
    assert gateway.decode.aborts == [gateway.decode.reserves[0].request_id]
    assert result.usage.completion_tokens < len(gateway.prefill.script.token_ids)


def test_streamed_stop_string_never_shows_and_equals_the_whole(gateway: Gateway):
    body = {"model": MODEL, "prompt": "Say hello", "max_tokens": 50, "stop": ["brown fox"], "stream": True}
    events = _sse_events(gateway, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == SCRIPT_TEXT[: SCRIPT_TEXT.index("brown fox")]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "stop"


def test_include_stop_str_in_output_keeps_the_stop_string(gateway: Gateway):
    result = gateway.openai().completions.create(
        model=MODEL, prompt="x", max_tokens=50, stop="fox", extra_body={"include_stop_str_in_output": True}
    )
    assert result.choices[0].text == SCRIPT_TEXT[: SCRIPT_TEXT.index("fox") + 3]


def test_a_stop_on_the_first_token_skips_decode_and_frees_the_reservation(gateway: Gateway, script):
    result = gateway.openai().completions.create(
        model=MODEL, prompt="Say hello", max_tokens=8, extra_body={"stop_token_ids": [script.token_ids[0]]}
    )
    assert result.choices[0].finish_reason == "stop"
    assert result.usage.completion_tokens == 1
    assert gateway.decode.decodes == []
    assert gateway.decode.aborts == [gateway.decode.reserves[0].request_id]


def test_max_tokens_1_reserves_no_decode_room_and_sends_no_state_target(gateway: Gateway):
    result = gateway.openai().completions.create(model=MODEL, prompt="Say hello", max_tokens=1)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 1
    assert gateway.decode.reserves == [] and gateway.decode.aborts == [] and gateway.decode.decodes == []
    (prefill,) = gateway.prefill.requests
    assert prefill.store_address == "" and prefill.state_key == ""


def test_stop_string_on_the_first_token_skips_decode(gateway: Gateway):
    result = gateway.openai().completions.create(model=MODEL, prompt="Say hello", max_tokens=20, stop="Hel")
    assert result.choices[0].text == ""
    assert result.choices[0].finish_reason == "stop"
    assert gateway.decode.decodes == []
    assert len(gateway.decode.aborts) == 1


def test_completion_logprobs_have_one_entry_per_token_with_top_n(gateway: Gateway, tokenizer):
    result = gateway.openai().completions.create(model=MODEL, prompt="x", max_tokens=5, logprobs=3)
    logprobs = result.choices[0].logprobs
    script = gateway.prefill.script.token_ids[:5]
    assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in script]
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == 5
    assert logprobs.token_logprobs[0] == -0.25
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)  # equal token strings share a key
    assert all(
        top[tok] == lp
        for top, tok, lp in zip(logprobs.top_logprobs, logprobs.tokens, logprobs.token_logprobs)
    )
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[1] == len(logprobs.tokens[0])
    assert gateway.prefill.requests[0].sampling_params.logprobs == 3


def test_chat_logprobs_list_top_logprobs_in_rank_order(gateway: Gateway):
    result = gateway.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_chat_logprobs_without_top_logprobs_send_zero(gateway: Gateway):
    result = gateway.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, logprobs=True
    )
    assert gateway.prefill.requests[0].sampling_params.logprobs == 0
    assert [e.top_logprobs for e in result.choices[0].logprobs.content] == [[], []]


def test_return_tokens_as_token_ids_names_tokens_by_id(gateway: Gateway):
    result = gateway.openai().completions.create(
        model=MODEL, prompt="x", max_tokens=3, logprobs=1, extra_body={"return_tokens_as_token_ids": True}
    )
    script = gateway.prefill.script.token_ids[:3]
    assert result.choices[0].logprobs.tokens == [f"token_id:{t}" for t in script]
    assert list(result.choices[0].logprobs.top_logprobs[0]) == [f"token_id:{script[0]}"]
    assert result.choices[0].text == SCRIPT_TEXT[: len(result.choices[0].text)]  # text stays text
    three = gateway.openai().completions.create(
        model=MODEL, prompt="x", max_tokens=3, logprobs=3, extra_body={"return_tokens_as_token_ids": True}
    )
    tops = three.choices[0].logprobs.top_logprobs
    assert [list(top) for top in tops] == [
        [f"token_id:{t}", f"token_id:{t + 100}", f"token_id:{t + 101}"] for t in script
    ]
    chat = gateway.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert [e.token for e in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in script[:2]]


def test_vllm_sampling_extras_reach_the_workers(gateway: Gateway):
    gateway.openai().completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=8,
        temperature=0.5,
        top_p=0.9,
        seed=1234,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        extra_body={
            "top_k": 7,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [EOS_TOKEN_ID, 77],
            "skip_special_tokens": False,
        },
    )
    params = gateway.prefill.requests[0].sampling_params
    assert params == gateway.decode.decodes[0].sampling_params
    assert (params.temperature, params.top_k, params.seed, params.min_tokens) == (0.5, 7, 1234, 2)
    assert abs(params.top_p - 0.9) < 1e-6 and abs(params.min_p - 0.05) < 1e-6
    assert abs(params.repetition_penalty - 1.1) < 1e-6
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.ignore_eos and not params.skip_special_tokens
    assert list(params.stop_token_ids) == [EOS_TOKEN_ID, 77]


def test_models_lists_the_served_model(gateway: Gateway):
    models = gateway.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
