"""Long text prompts are tokenized off the event loop, with the GIL released, to the same ids."""

from __future__ import annotations

import asyncio
import threading

import pytest

from frontend.inputs import LONG_TEXT_CHARS, off_the_loop_if_long, tokenize_chat
from splitserve.tokenizer import Tokenizer
from tests.frontend.conftest import MODEL, running_gateway

LONG_TEXT = ("The quick brown fox jumps over the lazy dog. Ünïcödé, 数字 42! " * 400)[: LONG_TEXT_CHARS + 500]


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", ["", "hi", "<|im_start|>user\nhello<|im_end|>", LONG_TEXT])
def test_encoding_without_the_gil_gives_the_same_ids(tokenizer: Tokenizer, text, add_special_tokens):
    expected = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert tokenizer.encode_releasing_gil(text, add_special_tokens=add_special_tokens) == expected


def test_only_long_inputs_leave_the_event_loop_thread():
    async def where(num_chars: int) -> threading.Thread:
        return await off_the_loop_if_long(num_chars, threading.current_thread)

    async def both() -> tuple[threading.Thread, threading.Thread, threading.Thread]:
        loop_thread = threading.current_thread()
        return loop_thread, await where(LONG_TEXT_CHARS - 1), await where(LONG_TEXT_CHARS)

    loop_thread, short, long = asyncio.run(both())
    assert short is loop_thread
    assert long is not loop_thread


def test_a_long_completions_prompt_reaches_the_worker_as_the_tokenizers_ids(
    tiny_model_path, script, tokenizer
):
    expected = tokenizer.encode(LONG_TEXT)
    with running_gateway(tiny_model_path, script, max_model_len=len(expected) + 16) as gateway:
        with gateway.http() as http:
            response = http.post(
                "/v1/completions", json={"model": MODEL, "prompt": LONG_TEXT, "max_tokens": 2}
            )
        assert response.status_code == 200, response.text
        assert list(gateway.prefill.requests[0].prompt_token_ids) == expected


def test_a_long_chat_message_reaches_the_worker_as_the_templates_ids(tiny_model_path, script, tokenizer):
    messages = [{"role": "user", "content": LONG_TEXT}]
    expected = tokenize_chat(messages, tokenizer, add_generation_prompt=True, template_kwargs=None)
    with running_gateway(tiny_model_path, script, max_model_len=len(expected) + 16) as gateway:
        with gateway.http() as http:
            body = {"model": MODEL, "messages": messages, "max_tokens": 2}
            response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert list(gateway.prefill.requests[0].prompt_token_ids) == expected
