"""The OpenAI request shapes the gateway takes, and their SamplingParams (the response shapes are
in `frontend.openai_responses`, re-exported here).

Requests follow OpenAI's fields plus vLLM's sampling extras. Fields OpenAI or vLLM define that
this gateway cannot honour (`echo`, streamed `best_of > n`, `logit_bias`, `suffix`, tools, and the table in
`frontend.request_checks`) are rejected with a 400 rather than silently ignored; fields nobody
defines are ignored with a warning, as vLLM does. Integers bound for an int32 protobuf field are
bounded here, so none can overflow on the way to a worker.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from frontend.errors import bad_request

# the response shapes live in their own module; importers of them from here keep working
from frontend.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from frontend.prompt_shape import INT32_MAX, Prompt, integral
from frontend.request_checks import check_raw_request, log_unknown_fields
from frontend.request_counts import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_METADATA_ENTRIES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from frontend.schema_bounds import (
    MAX_NEW_TOKENS,
    TOKEN_ID,
    content_schema,
    documented,
    state_request_limits,
)
from splitserve.sampling_params import MAX_LOGPROBS, MAX_SAMPLES, SamplingParams

# The bounds first, the validator after: so the schema says minimum/maximum (pydantic writes a
# constraint outside a validated type as `ge`/`le`, which JSON Schema does not know).
Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX), BeforeValidator(integral)]
# What the server enforces past pydantic, stated in the schema (frontend.schema_bounds).
MaxTokens = Annotated[Int32, documented(minimum=1, bound=MAX_NEW_TOKENS)]
NumLogprobs = Annotated[Int32, documented(minimum=0, maximum=MAX_LOGPROBS)]
Penalty = Annotated[float, documented(minimum=-2, maximum=2)]
# Roles a chat message may have. OpenAI's "tool" and "function" answer tool calls, unsupported here.
CHAT_ROLES = ("system", "developer", "user", "assistant")
# What the server passes the chat template itself (splitserve.tokenizer): not a chat_template_kwargs key.
TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "bos_token", "eos_token")
StopText = Annotated[str, documented(minLength=1)]  # SamplingParams refuses an empty stop string


class StreamOptions(BaseModel):
    """What a stream adds: a last usage chunk. vLLM's per-chunk usage is refused; OpenAI's
    obfuscation padding is never sent, which changes nothing a client reads."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, json_schema_extra={"enum": [False]})
    include_obfuscation: bool | None = None


class _Request(BaseModel):
    # JSON has no NaN or infinity; Python's parser reads them, and no sampler takes them. Strict:
    # a value is the JSON type the schema names (no "5" or 5.0 for an integer, no 0 for a boolean),
    # so the server takes what the OpenAPI document says and nothing else.
    model_config = ConfigDict(
        extra="allow", allow_inf_nan=False, strict=True, json_schema_extra=state_request_limits
    )
    # the fields whose items are counted on the raw JSON, before anything is done per item
    _COUNTED: ClassVar[tuple[str, ...]] = ("stop", "stop_token_ids", "metadata")

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, documented(minimum=0)] | None = None
    top_p: Annotated[float, documented(exclusiveMinimum=0, maximum=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES), BeforeValidator(integral)] = 1  # from one prefill
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: (
        Annotated[
            int,
            Field(ge=0, le=2**63 - 1),
            BeforeValidator(integral),
            documented(maximum=None, exclusiveMaximum=2**63),  # exact in a float, as FastAPI writes it
        ]
        | None
    ) = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"maxProperties": 0})
    user: str | None = None
    # OpenAI's bookkeeping fields: accepted and ignored (nothing a client reads depends on them)
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA_ENTRIES)] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM extras
    ignore_eos: bool = False
    top_k: Annotated[Int32, documented(minimum=-1)] | None = None
    min_p: Annotated[float, documented(minimum=0, maximum=1)] = 0.0
    repetition_penalty: Annotated[float, documented(exclusiveMinimum=0)] = 1.0
    min_tokens: Annotated[Int32, documented(minimum=0, bound=MAX_NEW_TOKENS)] = 0
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: (
        Annotated[
            list[
                Annotated[
                    int, Field(le=INT32_MAX), BeforeValidator(integral), documented(minimum=0, bound=TOKEN_ID)
                ]
            ],
            Field(max_length=MAX_STOP_TOKEN_IDS),
        ]
        | None
    ) = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_raw(cls, data: Any) -> Any:
        # raises a GatewayError (400), which pydantic lets through
        check_raw_request(data, cls._COUNTED, cls.model_fields)
        return data

    @model_validator(mode="after")
    def _warn_unknown_fields(self) -> _Request:
        log_unknown_fields(self.model_extra or ())
        return self

    def _reject_unsupported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise bad_request(
                "stream_options.continuous_usage_stats is not supported; include_usage adds one last "
                "chunk with the usage",
                "stream_options.continuous_usage_stats",
            )

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, best_of: int | None = None
    ) -> SamplingParams:
        try:
            return SamplingParams(
                n=self.n,
                best_of=best_of,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=self.min_p,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ValueError as exc:
            raise bad_request(str(exc), _param_of(str(exc))) from exc

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def unused_max_tokens(self) -> list[int]:
        """Token limits given but overridden by another field (checked all the same)."""
        return []

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """POST /v1/completions. `prompt` may be text, a list of texts, token ids or lists of them."""

    _COUNTED: ClassVar[tuple[str, ...]] = (*_Request._COUNTED, "prompt")
    prompt: Prompt
    max_tokens: MaxTokens | None = 16
    logprobs: NumLogprobs | None = None
    echo: bool = Field(False, json_schema_extra={"enum": [False]})
    best_of: Annotated[int, Field(ge=1, le=MAX_SAMPLES), BeforeValidator(integral)] | None = None
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list (one choice each); a 400 when empty."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise bad_request("prompt must not be empty", "prompt")
        return prompts

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        self._reject_unsupported()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise bad_request("best_of > n cannot be streamed (the best are known at the end)", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        return self._sampling_params(max_tokens, self.logprobs, self.best_of)


class ChatMessage(BaseModel):
    """One message in; its role and its text content are checked here, so the template gets text."""

    # the schema says what the validator below enforces: content is required, and not null
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"required": ["role", "content"]})

    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    # validate_default: a missing content is refused like a null one (with the validator's words)
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_CONTENT_PARTS)] | None = Field(
        None, validate_default=True, json_schema_extra=content_schema
    )
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(
                f"role {role!r} is not supported; use one of {', '.join(CHAT_ROLES)} "
                "(tool messages need tools, which this server does not support)"
            )
        return role

    @field_validator("content")
    @classmethod
    def _text_content(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]]:
        if content is None:
            raise ValueError(
                "content must be a string or a list of text parts, not null (null content goes with "
                "tool calls, which this server does not support)"
            )
        for i, part in enumerate(content if isinstance(content, list) else []):
            if part.get("type") != "text":
                raise ValueError(f"content part type {part.get('type')!r} is not supported; only 'text'")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} has type 'text' but no string 'text'")
        return content


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions. `logprobs` is a flag here; `top_logprobs` says how many."""

    _COUNTED: ClassVar[tuple[str, ...]] = (*_Request._COUNTED, "messages")
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[dict[str, Any]] | None = Field(None, json_schema_extra={"maxItems": 0})
    response_format: Annotated[dict[str, Any], documented(properties={"type": {"enum": ["text"]}})] | None = (
        None
    )
    add_generation_prompt: bool = True
    # the names the server gives the template itself cannot be given twice
    chat_template_kwargs: (
        Annotated[dict[str, Any], documented(propertyNames={"not": {"enum": list(TEMPLATE_ARGUMENTS)}})]
        | None
    ) = None

    def requested_max_tokens(self) -> int | None:
        """OpenAI's newer name first; `max_tokens` is its deprecated spelling."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unused_max_tokens(self) -> list[int]:
        both = self.max_completion_tokens is not None and self.max_tokens is not None
        return [self.max_tokens] if both and self.max_tokens is not None else []

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (fields left unset are left out)."""
        return [message.model_dump(exclude_none=True) for message in self.messages]

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        self._reject_unsupported()
        if self.tools:
            raise bad_request("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("only response_format type 'text' is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}] (got {self.top_logprobs})", "top_logprobs"
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


def _param_of(message: str) -> str | None:
    """SamplingParams' messages start with the field they are about."""
    first = message.split(" ", 1)[0]
    return first if first.isidentifier() else None


__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "PromptTokensDetails",
    "UsageInfo",
    "CompletionLogprobs",
    "CompletionChoice",
    "CompletionResponse",
    "TopLogprob",
    "ChatTokenLogprob",
    "ChatLogprobs",
    "ChatMessageOut",
    "ChatChoice",
    "ChatCompletionResponse",
    "DeltaMessage",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ModelCard",
    "ModelList",
]
