"""A completions request's `prompt`: its four shapes, checked in one pass with a fast path for
the shape long prompts come in (a list of token ids).

`Prompt` is what the OpenAPI document says (a text, texts, token ids, lists of token ids; none
empty); `valid_prompt` is what the server enforces. pydantic would try the four shapes of the
union in turn, each walking the whole list, after a Python check of every id: ~60 ms for a 32k-id
prompt. Here a list of ints is validated once, in pydantic-core (type and int32 range together);
anything else, or a list of ids that fails, takes the general path, which names what is wrong.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PlainValidator, Strict, TypeAdapter, ValidationError

INT32_MAX = 2**31 - 1  # the largest value of a protobuf int32 field (top_k, token ids, max_tokens ...)


def integral(value: Any) -> Any:
    """JSON Schema counts 5.0 as an integer, and the document says `integer`: take it as 5.
    (Strings and booleans stay refused: the models are strict.)"""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# The bounds first, the validator after: so the schema says minimum/maximum (pydantic writes a
# constraint outside a validated type as `ge`/`le`, which JSON Schema does not know).
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX), BeforeValidator(integral)]
# The schema says what `valid_prompt` enforces: nothing empty.
PromptShapes = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)

# Plain ints (no bool, no 5.0) in the int32 range: checked in pydantic-core, in one pass.
_PLAIN_TOKEN_IDS = TypeAdapter(list[Annotated[int, Strict(), Field(ge=0, le=INT32_MAX)]])
_SHAPE_ERROR = (
    "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"
)


def valid_prompt(prompt: Any) -> str | list[str] | list[int] | list[list[int]]:
    """The prompt as the request carries it (integral floats as ints); a ValueError saying what is
    wrong when it is empty, holds an empty prompt, has none of the four shapes or an id out of range."""
    if isinstance(prompt, str) and prompt:
        return prompt
    if type(prompt) is list and prompt:
        if type(prompt[0]) is int:
            fast = _plain_token_ids(prompt)
            if fast is not None:
                return fast
        elif type(prompt[0]) is list:
            batch = [_plain_token_ids(p) if p and type(p[0]) is int else None for p in prompt]
            if all(ids is not None for ids in batch):
                return [ids for ids in batch if ids is not None]
    return _general_prompt(prompt)


def _plain_token_ids(ids: list[Any]) -> list[int] | None:
    """The ids when every one is a plain int in range; None when any is not (the general path
    then says which)."""
    try:
        return _PLAIN_TOKEN_IDS.validate_python(ids)
    except ValidationError:
        return None


def _general_prompt(prompt: Any) -> Any:
    """Every shape, integral floats, and the error for a prompt that is none of them."""
    if prompt == "" or prompt == [] or (isinstance(prompt, list) and any(p in ("", []) for p in prompt)):
        raise ValueError("prompt must not be empty, nor hold an empty prompt")
    if isinstance(prompt, list):
        prompt = [[integral(t) for t in p] if isinstance(p, list) else integral(p) for p in prompt]
    if isinstance(prompt, str):
        return prompt
    if _is_token_ids(prompt):
        _check_id_range(prompt)
        return prompt
    if isinstance(prompt, list) and (
        all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt)
    ):
        for ids in prompt:
            _check_id_range(ids)
        return prompt
    raise ValueError(_SHAPE_ERROR)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_id_range(prompt: str | list[int]) -> None:
    """Token ids fit a protobuf int32 and are not negative (the vocabulary check comes later,
    where the tokenizer is known); a ValueError naming the first that does not."""
    if isinstance(prompt, str):
        return
    bad = next((t for t in prompt if not 0 <= t <= INT32_MAX), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range; token ids are in [0, 2**31)")


# The field's type: validated by `valid_prompt` alone, documented as the four shapes.
Prompt = Annotated[PromptShapes, PlainValidator(valid_prompt, json_schema_input_type=PromptShapes)]
