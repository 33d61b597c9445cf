"""Steps to OpenAI response objects, the same way for a stream and for a whole response.

A non-streamed choice is rendered from the concatenation of its steps with the same code that
renders each streamed chunk, so the two always agree on text, tokens and logprobs.
"""

from __future__ import annotations

import dataclasses

from frontend.generate import Generation
from frontend.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from frontend.steps import Step
from splitserve.tokenizer import Tokenizer


def concat_steps(steps: list[Step]) -> Step:
    """One step holding everything `steps` added, with the last one's finish."""
    has_logprobs = any(s.logprobs is not None for s in steps)
    return Step(
        token_ids=[t for s in steps for t in s.token_ids],
        text="".join(s.text for s in steps),
        logprobs=[lp for s in steps for lp in (s.logprobs or [])] if has_logprobs else None,
        finish_reason=steps[-1].finish_reason if steps else None,
        stop_reason=steps[-1].stop_reason if steps else None,
    )


def usage_of(gens: list[Generation]) -> UsageInfo:
    """Prompt, cached prompt and generated tokens of a request's generations, as they stand: each
    prompt counted once however many samples it has (as OpenAI counts `n`), every sample's tokens
    (`best_of`'s unreturned ones too)."""
    billed = [g for g in gens if g.bills_prompt]
    num_prompt_tokens = sum(len(g.prompt_ids) for g in billed)
    num_completion_tokens = sum(g.num_generated_tokens for g in gens)
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(g.num_cached_tokens for g in billed)),
    )


def best_choices(steps: list[list[Step]], n: int, num_samples: int, keep_logprobs: bool) -> list[Step]:
    """The choices of whole responses from every sample's steps (prompt-major, `num_samples` a
    prompt): all of them, or, when more were drawn than asked for (`best_of`), each prompt's `n` of
    highest cumulative logprob, best first, without the logprobs drawn for the ranking alone."""
    whole = [concat_steps(s) for s in steps]
    if num_samples == n:
        return whole
    chosen: list[Step] = []
    for start in range(0, len(whole), num_samples):
        ranked = sorted(whole[start : start + num_samples], key=_cumulative_logprob, reverse=True)[:n]
        chosen += ranked if keep_logprobs else [dataclasses.replace(step, logprobs=None) for step in ranked]
    return chosen


def _cumulative_logprob(step: Step) -> float:
    pairs = zip(step.token_ids, step.logprobs or [])
    return sum(_sampled_logprob(token_id, entries) or 0.0 for token_id, entries in pairs)


class TokenRenderer:
    """How one request shows single tokens in logprobs: their text, or `token_id:N`.

    Owns the running character offset of a completions choice (`text_offset`), so one renderer
    serves one choice.
    """

    def __init__(self, tokenizer: Tokenizer | None, as_token_ids: bool, num_top_logprobs: int) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids or tokenizer is None
        self.num_top_logprobs = num_top_logprobs
        self.text_offset = 0

    def token(self, token_id: int) -> str:
        if self.as_token_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, step: Step) -> CompletionLogprobs | None:
        if step.logprobs is None:
            return None
        out = CompletionLogprobs()
        for token_id, entries in zip(step.token_ids, step.logprobs):
            text = self.token(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(_sampled_logprob(token_id, entries))
            out.top_logprobs.append({self.token(t): lp for t, lp in entries})
            out.text_offset.append(self.text_offset)
            self.text_offset += len(text)
        return out

    def chat_logprobs(self, step: Step) -> ChatLogprobs | None:
        if step.logprobs is None:
            return None
        content = []
        for token_id, entries in zip(step.token_ids, step.logprobs):
            ranked = sorted(entries, key=lambda pair: -pair[1])[: self.num_top_logprobs]
            content.append(
                ChatTokenLogprob(
                    **self._top(token_id, _sampled_logprob(token_id, entries)).model_dump(),
                    top_logprobs=[self._top(t, lp) for t, lp in ranked],
                )
            )
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float | None) -> TopLogprob:
        text = self.token(token_id)
        return TopLogprob(
            token=text, logprob=-9999.0 if logprob is None else logprob, bytes=list(text.encode("utf-8"))
        )


def _sampled_logprob(token_id: int, entries: list[tuple[int, float]]) -> float | None:
    """Entry 0 is the sampled token by the wire contract; look it up to be safe."""
    if entries and entries[0][0] == token_id:
        return entries[0][1]
    return next((lp for t, lp in entries if t == token_id), None)
