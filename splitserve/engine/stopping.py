"""When a request stops: EOS, a stop token, `max_tokens`, or the context limit (vLLM's rules); and,
for async scheduling, when tokens not yet read already end it."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.engine.request import Request


def check_stop(
    request: Request, eos_token_ids: Sequence[int], max_model_len: int
) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) once the last sampled token ends the request, else None."""
    params = request.params
    num_out = len(request.output_token_ids)
    last = request.output_token_ids[-1]
    if num_out >= params.min_tokens:
        if not params.ignore_eos and last in eos_token_ids:
            return "stop", None
        if last in params.stop_token_ids:
            return "stop", last
    if num_out >= request.max_tokens or request.num_prompt_tokens + num_out >= max_model_len:
        return "length", None
    return None


def ends_with_pending(request: Request, max_model_len: int) -> bool:
    """Whether the request's pending tokens (sampled, ids not read yet) end it whatever they are:
    the last one reaches `max_tokens` or the context limit, or it is prefill-only (it ends after its
    first token). Such a request needs no next step."""
    if not request.num_pending_tokens:
        return False
    return (
        request.prefill_only
        or request.num_output_tokens >= request.max_tokens
        or request.num_tokens >= max_model_len
    )
