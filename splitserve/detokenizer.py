"""Incremental detokenization with stop strings (vLLM's prefix/read-offset method). Torch-free.

Decoding only a short window of recent tokens keeps each step O(1); a window whose text ends in
an incomplete UTF-8 sequence ("\\ufffd") is held back until the next token completes it. Text
that could be the start of a stop string is held back too, so a stream never shows it.
"""

from __future__ import annotations

from splitserve.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Owns one request's output text; `push` returns the newly printable text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids = list(prompt_token_ids[-6:])  # a little prompt context decodes the first token right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0
        self.stop_reason: str | None = None

    def push(self, token_ids: list[int]) -> str:
        """Append tokens; return the new text safe to show (empty while held back)."""
        for token in token_ids:
            if self.stop_reason is not None:
                break
            self.ids.append(token)
            prefix = self.tokenizer.decode(
                self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
            )
            full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                self._check_stop(len(full) - len(prefix))
        end = (
            len(self.text) if self.stop_reason is not None else max(self.emitted, len(self.text) - self.hold)
        )
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def flush(self) -> str:
        """At the end of the request: whatever was held back for a stop string that never came."""
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta

    def _check_stop(self, new_chars: int) -> None:
        if not self.stop:
            return
        search_from = max(0, len(self.text) - new_chars - self.hold)
        hits = [(at, stop) for stop in self.stop if (at := self.text.find(stop, search_from)) != -1]
        if hits:
            at, stop = min(hits)
            self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
            self.stop_reason = stop
