"""Prompts of an exact token length, drawn from a seeded random source."""

from __future__ import annotations

import random

from bench.datasets.base import Prompt
from bench.tokenizer import BenchTokenizer

# Fewer word-start tokens than this and prompts draw from the whole (clean) vocabulary instead.
_MIN_WORD_VOCAB = 64
_MAX_FIT_ROUNDS = 20
FIRST_TOKEN_ID = 3  # token-id prompts avoid the ids tokenizers usually give pad, bos and eos


class PromptFactory:
    """Makes prompts of a given token length from `rng`; the same rng state gives the same prompts.

    With a tokenizer it makes text that the tokenizer encodes to exactly that many tokens: random
    ids are decoded, re-encoded and trimmed or padded until the count matches, as vLLM does. The
    ids come from the vocabulary's word-start tokens (those that decode to one whitespace-led
    word and encode back to themselves): their texts join without merging across the seams, so
    the count is right at once and concatenated prompts add up. Without a tokenizer it makes
    token ids, uniform in [3, vocab_size).
    """

    def __init__(self, tokenizer: BenchTokenizer | None, rng: random.Random, vocab_size: int = 2048) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self._vocab = _draw_vocab(tokenizer) if tokenizer is not None else range(FIRST_TOKEN_ID, vocab_size)

    def token_ids(self, num_tokens: int) -> list[int]:
        """`num_tokens` random ids from the vocabulary prompts are drawn from."""
        return [self._vocab[self.rng.randrange(len(self._vocab))] for _ in range(num_tokens)]

    def prompt(self, num_tokens: int) -> tuple[Prompt, int]:
        """A prompt of `num_tokens` tokens and its measured length (text with a tokenizer, else ids)."""
        ids = self.token_ids(num_tokens)
        if self.tokenizer is None:
            return tuple(ids), num_tokens
        return self.fit_text(ids, num_tokens)

    def join(self, first: Prompt, second: Prompt) -> tuple[Prompt, int]:
        """`first` followed by `second` (both text or both ids), and the joined prompt's length."""
        if isinstance(first, str) and isinstance(second, str):
            return first + second, self.count(first + second)
        if isinstance(first, tuple) and isinstance(second, tuple):
            return first + second, len(first) + len(second)
        raise TypeError("cannot join a text prompt and a token-id prompt")

    def fit_text(self, token_ids: list[int], num_tokens: int) -> tuple[str, int]:
        """Text from `token_ids` that encodes to `num_tokens` tokens, and its length.

        The length returned is the measured one; it differs from `num_tokens` only when the
        tokenizer never settles (no seen tokenizer does with word-start ids).
        """
        assert self.tokenizer is not None
        ids = list(token_ids)
        text = self.tokenizer.decode(ids)
        for _ in range(_MAX_FIT_ROUNDS):
            encoded = self.count_ids(text)
            if len(encoded) == num_tokens:
                break
            ids = (
                encoded[:num_tokens]
                if len(encoded) > num_tokens
                else encoded + self.token_ids(num_tokens - len(encoded))
            )
            text = self.tokenizer.decode(ids)
        return text, self.count(text)

    def count_ids(self, text: str) -> list[int]:
        assert self.tokenizer is not None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def count(self, text: str) -> int:
        """How many tokens `text` is, without special tokens."""
        return len(self.count_ids(text))


def _draw_vocab(tokenizer: BenchTokenizer) -> list[int]:
    clean, words = [], []
    for token_id in range(tokenizer.vocab_size):
        if token_id in tokenizer.special_ids:
            continue
        text = tokenizer.decode([token_id])
        if not text or "\ufffd" in text:  # empty, or a partial UTF-8 sequence
            continue
        clean.append(token_id)
        if (
            text[0].isspace()
            and len(text) > 1
            and not any(c.isspace() for c in text[1:])
            and tokenizer.encode(text, add_special_tokens=False) == [token_id]
        ):
            words.append(token_id)
    vocab = words if len(words) >= _MIN_WORD_VOCAB else clean
    if not vocab:
        raise ValueError("the tokenizer has no token that decodes to text; prompts cannot be drawn from it")
    return vocab


def uniform_length(rng: random.Random, length: int, range_ratio: float) -> int:
    """A length uniform over the integers in [length * (1 - r), length * (1 + r)], at least 1."""
    low = max(1, _ceil(length * (1 - range_ratio)))
    high = max(low, _floor(length * (1 + range_ratio)))
    return rng.randint(low, high)


def _ceil(x: float) -> int:
    return -_floor(-x)


def _floor(x: float) -> int:
    # 100 * 0.9 is 90.00000000000001; rounding first keeps such products on their integer.
    return int(round(x, 9) // 1)
