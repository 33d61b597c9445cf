"""Requests end where vLLM's rules say: max_tokens, EOS, stop token ids, stop strings, context."""

from __future__ import annotations

from splitserve import SamplingParams

PROMPT = [21, 8, 301, 77, 5]


def _greedy_tokens(llm, n: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs[0].token_ids


def test_max_tokens_ends_with_length(tiny_llm):
    out = tiny_llm.generate(
        prompt_token_ids=[PROMPT],
        sampling_params=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    )
    assert len(out[0].outputs[0].token_ids) == 5
    assert out[0].outputs[0].finish_reason == "length"


def test_stop_token_id_ends_with_stop_and_names_the_token(tiny_llm):
    tokens = _greedy_tokens(tiny_llm, 12)
    target = tokens[6]
    first = tokens.index(target)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[target])
    out = tiny_llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_eos_stops_unless_ignored(tiny_llm):
    tokens = _greedy_tokens(tiny_llm, 10)
    engine = tiny_llm.engine
    original = engine.model_config
    eos = tokens[3]
    engine.model_config = original.__class__(**{**original.__dict__, "eos_token_ids": (eos,)})
    try:
        stopped = tiny_llm.generate(
            prompt_token_ids=[PROMPT], sampling_params=SamplingParams(temperature=0, max_tokens=10)
        )
        ignored = tiny_llm.generate(
            prompt_token_ids=[PROMPT],
            sampling_params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        )
        min_tok = tiny_llm.generate(
            prompt_token_ids=[PROMPT],
            sampling_params=SamplingParams(temperature=0, max_tokens=10, min_tokens=8),
        )
    finally:
        engine.model_config = original
    assert stopped[0].outputs[0].token_ids == tokens[: tokens.index(eos) + 1]
    assert stopped[0].outputs[0].finish_reason == "stop"
    assert len(ignored[0].outputs[0].token_ids) == 10
    assert len(min_tok[0].outputs[0].token_ids) >= 8


def test_context_limit_ends_with_length(tiny_llm):
    limit = tiny_llm.engine.max_model_len
    prompt = [9] * (limit - 3)
    out = tiny_llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
    )
    assert len(out[0].outputs[0].token_ids) == 3
    assert out[0].outputs[0].finish_reason == "length"


def test_stop_string_truncates_text(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, skip_special_tokens=True)
    full = tiny_llm.generate(prompts=["The quick brown fox"], sampling_params=params)[0].outputs[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = tiny_llm.generate(prompts=["The quick brown fox"], sampling_params=params.replace(stop=[stop]))[
        0
    ].outputs[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = tiny_llm.generate(
        prompts=["The quick brown fox"],
        sampling_params=params.replace(stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_text_prompts_and_outputs_decode(tiny_llm):
    out = tiny_llm.generate(
        prompts="Hello world", sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    assert out[0].prompt == "Hello world"
    assert out[0].prompt_token_ids == tiny_llm.tokenizer.encode("Hello world")
    assert out[0].outputs[0].text == tiny_llm.tokenizer.decode(out[0].outputs[0].token_ids)
