"""From a request to prompt token ids and a token budget, with every check before a worker.

Text is tokenized here (the chat template rendered first); token ids are taken as they are.
The context check names both numbers, as a user needs to fix the request. A text longer than
`max_prompt_chars` is refused before it is tokenized (a 20 MB prompt would hold the tokenizer
for seconds only to be refused for its token count); a chat's text is the prompt its template
rendered, so names and extra fields the template shows count too. Text goes through
the tokenizer's GIL-free path, and long inputs run on a worker thread (`off_the_loop_if_long`),
so one 100k-token prompt does not stall every stream the event loop serves for a fifth of a
second.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio.to_thread
import jinja2

from frontend.errors import bad_request, model_not_found
from frontend.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.sampling_params import SamplingParams
from splitserve.tokenizer import ChatTemplateError, Tokenizer

T = TypeVar("T")
logger = logging.getLogger(__name__)

# ~4k tokens, ~10 ms to tokenize here: past this a thread hop is cheaper than the loop's time.
LONG_TEXT_CHARS = 16_384


async def off_the_loop_if_long(num_chars: int, work: Callable[[], T]) -> T:
    """Run `work` inline for short inputs, on a worker thread for long ones."""
    if num_chars < LONG_TEXT_CHARS:
        return work()
    return await anyio.to_thread.run_sync(work)


def prompt_chars(prompts: Sequence[str | list[int]]) -> int:
    return sum(len(p) for p in prompts if isinstance(p, str))


def messages_chars(messages: list[dict[str, Any]]) -> int:
    """About the characters the template renders from `messages` (what decides a thread hop): their
    texts, and LONG_TEXT_CHARS for a value of another kind (what the template makes of it is unknown)."""
    return sum(_value_chars(value) for message in messages for value in message.values())


def _value_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list) and all(isinstance(part, dict) for part in value):  # content parts
        return sum(len(str(part.get("text", ""))) for part in value)
    return 0 if value is None else LONG_TEXT_CHARS


def check_prompt_chars(num_chars: int, max_prompt_chars: int, param: str, what: str | None = None) -> None:
    """A 400 for a text over the character limit, before any tokenizing; `what` names the text
    (by default `param`)."""
    if num_chars > max_prompt_chars:
        raise bad_request(
            f"{what or param} has {num_chars} characters; this gateway takes at most {max_prompt_chars} "
            "(gateway.max_prompt_chars) before tokenizing; shorten it",
            param,
        )


def require_tokenizer(tokenizer: Tokenizer | None, what: str) -> Tokenizer:
    if tokenizer is None:
        raise bad_request(
            f"this model has no tokenizer.json, so {what} cannot be used; send token ids instead"
        )
    return tokenizer


def tokenize_prompt(prompt: str | list[int], tokenizer: Tokenizer | None) -> list[int]:
    """Token ids of one completions prompt; ids are range-checked when the vocabulary is known."""
    if isinstance(prompt, str):
        return require_tokenizer(tokenizer, "text prompts").encode_releasing_gil(
            prompt, add_special_tokens=True
        )
    ids = list(prompt)
    check_token_ids(ids, tokenizer, "prompt")
    return ids


def check_token_ids(ids: list[int], tokenizer: Tokenizer | None, param: str) -> None:
    """Ids a request names must be in the vocabulary, when the gateway knows it (a tokenizer);
    else they must at least be non-negative. A worker would fail on them, or never match one.
    (`min` and `max` run in C: a long prompt of ids costs no Python frame per id.)"""
    if not ids:
        return
    low, high = min(ids), max(ids)
    if tokenizer is None:
        if low < 0:
            raise bad_request(f"{param} token ids must be non-negative", param)
        return
    vocab_size = tokenizer.vocab_size
    bad = low if low < 0 else high if high >= vocab_size else None
    if bad is not None:
        raise bad_request(
            f"{param} token id {bad} is out of range; the vocabulary has {vocab_size} tokens "
            f"(ids 0 to {vocab_size - 1})",
            param,
        )


def tokenize_chat(
    messages: list[dict[str, Any]],
    tokenizer: Tokenizer | None,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
    max_prompt_chars: int | None = None,
) -> list[int]:
    """Render the chat template and tokenize it (the template carries its own special tokens).
    The character limit counts what the template rendered: names, extra fields, template
    arguments, markup and all; a text over it is refused untokenized."""
    tokenizer = require_tokenizer(tokenizer, "chat messages")
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
        )
    except ChatTemplateError as exc:  # the template's own words, written for the user
        raise bad_request(str(exc), "messages") from exc
    except (ValueError, TypeError, LookupError, jinja2.TemplateError) as exc:  # internal text: log it
        logger.warning("the chat template failed on a request: %s: %s", type(exc).__name__, exc)
        raise bad_request(
            "the chat template could not render these messages; check their roles, order and "
            "chat_template_kwargs",
            "messages",
        ) from exc
    if max_prompt_chars is not None:
        check_prompt_chars(
            len(text), max_prompt_chars, "messages", "the chat prompt (messages as the template renders them)"
        )
    ids = tokenizer.encode_releasing_gil(text, add_special_tokens=False)
    if not ids:
        raise bad_request("the rendered chat prompt is empty", "messages")
    return ids


def token_budget(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """max_tokens to run with: as asked, or what is left of the context when not asked."""
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1 (got {max_tokens})", "max_tokens")
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"prompt has {num_prompt_tokens} tokens; this model's context is {max_model_len} tokens "
            "and must leave room for at least one generated token",
            "prompt",
        )
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(
            f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}, "
            f"{num_prompt_tokens + max_tokens} in all; this model's context is {max_model_len} tokens",
            "max_tokens",
        )
    return max_tokens


async def prompt_ids(
    body: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer | None, max_prompt_chars: int
) -> list[list[int]]:
    """Every prompt's token ids (one per choice): completions' prompts as they are or tokenized,
    chat's messages through the template; long texts are rendered and tokenized off the event
    loop, texts over `max_prompt_chars` (a chat's prompt as rendered) not tokenized at all."""
    if isinstance(body, ChatCompletionRequest):
        messages = body.template_messages()
        add_generation_prompt, template_kwargs = body.add_generation_prompt, body.chat_template_kwargs
        return await off_the_loop_if_long(
            messages_chars(messages) + LONG_TEXT_CHARS * bool(template_kwargs),
            lambda: [
                tokenize_chat(messages, tokenizer, add_generation_prompt, template_kwargs, max_prompt_chars)
            ],
        )
    texts = body.prompts()
    for text in texts:
        if isinstance(text, str):
            check_prompt_chars(len(text), max_prompt_chars, "prompt")
    return await off_the_loop_if_long(
        prompt_chars(texts), lambda: [tokenize_prompt(p, tokenizer) for p in texts]
    )


def sampling_params_for(
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    max_model_len: int,
    tokenizer: Tokenizer | None,
) -> SamplingParams:
    """The request's SamplingParams, with a max_tokens every prompt's context has room for. Chat's
    deprecated `max_tokens`, given beside `max_completion_tokens`, is unused but must fit too (the
    OpenAPI document bounds both)."""
    num_tokens = max(len(ids) for ids in prompts)
    for unused in body.unused_max_tokens():
        token_budget(num_tokens, unused, max_model_len)
    max_tokens = body.requested_max_tokens()
    params = body.sampling_params(token_budget(num_tokens, max_tokens, max_model_len))
    if params.stop:
        require_tokenizer(tokenizer, "stop strings")
    check_token_ids(params.stop_token_ids, tokenizer, "stop_token_ids")
    return params


def check_model(model: str | None, served: str) -> None:
    """A request may name the served model or none."""
    if model is not None and model != served:
        raise model_not_found(model, served)
