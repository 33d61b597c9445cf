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

from frontend.request_counts import MAX_PROMPTS
from frontend.schema_bounds import PROMPT_CHARS, TOKEN_ID, documented

INT32_MAX = 2**31 - 1  # the largest value of a protobuf int32 field (top_k, token ids, max_tokens ...)


def integral(value: Any) -> Any:
    """JSON Schema counts 5.0 as an integer, and the document says `integer`: take it as 5.
    (Strings and booleans stay refused: the models are strict.)"""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# The bounds first, the validator after: so the schema says minimum/maximum (pydantic writes a
# constraint outside a validated type as `ge`/`le`, which JSON Schema does not know).
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX), BeforeValidator(integral), documented(bound=TOKEN_ID)]
Text = Annotated[str, Field(min_length=1), documented(bound=PROMPT_CHARS)]
# The schema says what `valid_prompt` enforces: nothing empty; what the raw count check does: a
# list of prompts holds at most MAX_PROMPTS; and what the gateway serves: texts within its
# character limit, ids within its vocabulary (frontend.schema_bounds).
PromptShapes = (
    Text
    | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)
    ]
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
            batch = [
                _plain_token_ids(p) if type(p) is list and p and type(p[0]) is int else None for p in prompt
            ]
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
    """Every shape, integral floats, and the error for a prompt that is none of them. Work per
    token id or text is done in C (`in`, `map`, `min`): a long list costs no Python frame per item."""
    if prompt == "" or prompt == [] or (isinstance(prompt, list) and ("" in prompt or [] in prompt)):
        raise ValueError("prompt must not be empty, nor hold an empty prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        ids = _as_token_ids(prompt)
        if ids is not None:
            _check_id_range(ids)
            return ids
        kinds = set(map(type, prompt))
        if kinds == {str}:
            return prompt
        if kinds == {list}:  # a batch: one frame per prompt (their number is capped before this)
            batch = [_as_token_ids(p) for p in prompt]
            if all(ids is not None for ids in batch):
                for ids in batch:
                    _check_id_range(ids)  # type: ignore[arg-type]
                return batch
    raise ValueError(_SHAPE_ERROR)


def _as_token_ids(values: list[Any]) -> list[int] | None:
    """`values` as ints when each is an int or an integral float (not a bool); else None."""
    kinds = set(map(type, values))
    if not kinds <= {int, float}:
        return None
    if float not in kinds:
        return values
    try:
        ids = list(map(int, values))
    except (OverflowError, ValueError):  # an infinity or NaN a lenient parser let in
        return None
    return ids if ids == values else None  # 1.5 became 1: not an integer


def _check_id_range(ids: list[int]) -> None:
    """Token ids fit a protobuf int32 and are not negative (the vocabulary check comes later,
    where the tokenizer is known); a ValueError naming one that does not."""
    low, high = min(ids), max(ids)
    bad = low if low < 0 else high if high > INT32_MAX else None
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range; token ids are in [0, 2**31)")


# The field's type: validated by `valid_prompt` alone, documented as the four shapes.
Prompt = Annotated[PromptShapes, PlainValidator(valid_prompt, json_schema_input_type=PromptShapes)]
