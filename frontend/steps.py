"""From worker tokens to what a client sees: text detokenized, stop strings applied, tokens counted.

A worker stops on EOS, stop token ids and max_tokens; stop strings need text, so the gateway
applies them here, and tokens past a stop string are dropped before anyone sees them.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.detokenizer import IncrementalDetokenizer
from splitserve.sampling_params import SamplingParams
from splitserve.tokenizer import Tokenizer
from splitserve.v1 import common_pb2

# One output position's logprobs: (token id, logprob) pairs, the sampled token first.
TokenLogprobs = list[tuple[int, float]]


@dataclass
class Step:
    """What one worker message adds to the output, after stop strings are applied."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OutputSteps:
    """Owns one choice's output: its detokenizer (none without a tokenizer: ids only), the count
    of tokens shown, every token id a worker generated (`received_ids`: what a decode failover
    resumes from), and the finish reason once a step carried one."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.num_generated_tokens = 0
        self.received_ids: list[int] = []
        self.finish_reason: str | None = None
        self._detok = (
            IncrementalDetokenizer(
                tokenizer,
                prompt_ids,
                stop=params.stop,
                skip_special_tokens=params.skip_special_tokens,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            if tokenizer is not None
            else None
        )

    def step(
        self,
        token_ids: list[int],
        logprobs: list[common_pb2.TokenLogprobs],
        finish_reason: str | None,
        stop_token_id: int | None,
    ) -> Step:
        """Detokenize, apply stop strings, count; tokens after a stop string are dropped."""
        self.received_ids.extend(token_ids)
        pairs = (
            [list(zip(lp.token_ids, lp.logprobs)) for lp in logprobs]
            if self.params.logprobs is not None
            else None
        )
        stop_reason: int | str | None = stop_token_id
        text = ""
        if self._detok is not None:
            hidden = 1 if stop_token_id is not None and not self.params.include_stop_str_in_output else 0
            visible = token_ids[: len(token_ids) - hidden]
            before = len(self._detok.ids)
            text = self._detok.push(visible)
            if self._detok.stop_reason is not None:
                token_ids = token_ids[: len(self._detok.ids) - before]
                finish_reason, stop_reason = "stop", self._detok.stop_reason
            elif finish_reason is not None:
                text += self._detok.flush()
        if pairs is not None:
            pairs = pairs[: len(token_ids)]
        self.num_generated_tokens += len(token_ids)
        self.finish_reason = finish_reason
        return Step(token_ids, text, pairs, finish_reason, stop_reason if finish_reason else None)
