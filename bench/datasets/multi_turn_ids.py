"""The multi-turn dataset sent as token ids, and the token-id conversation a session builds.

Turn k sends, as a completions `prompt` of token ids, turn k-1's prompt, the token ids the
server generated for it and the new user message's ids. Nothing goes through text, so the
next turn's prompt starts with exactly the tokens the server has already computed (prompt and
reply): the reuse a prefix cache offers a chat model whose replies re-encode to themselves,
which a tiny random model's replies mostly do not when sent back as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.datasets.base import Dataset, Session, Turn
from bench.datasets.config import DatasetConfig
from bench.datasets.multi_turn import user_messages
from bench.tokenizer import BenchTokenizer

# The request fields that make the gateway return each generated token's id ("token_id:N" in
# the completions logprobs), so the reply can be sent back without decoding it.
TOKEN_ID_FIELDS = {"logprobs": 0, "return_tokens_as_token_ids": True}


def build_multi_turn_ids(config: DatasetConfig, tokenizer: BenchTokenizer | None) -> Dataset:
    """`mt_num_sessions` sessions of `mt_turns` user messages of `mt_user_len` token ids each.

    With a tokenizer the messages are the multi-turn dataset's texts (same seed), encoded; without
    one, ids uniform in [3, vocab_size).
    """
    sessions = []
    for session_id, messages in enumerate(user_messages(config, tokenizer)):
        turns = []
        for message, _ in messages:
            if isinstance(message, str):
                assert tokenizer is not None
                message = tuple(tokenizer.encode(message, add_special_tokens=False))
            turns.append(Turn(message, len(message), config.mt_output_len))
        sessions.append(Session(session_id, tuple(turns)))
    return Dataset(config.name, sessions=tuple(sessions))


@dataclass
class TokenConversation:
    """One session's history as token ids: every user message and reply so far, in order.

    `prompt()` is what the next turn sends: the previous turn's prompt, its reply, the new message.
    """

    token_ids: list[int] = field(default_factory=list)
    _waiting: bool = False

    def ask(self, user_message: tuple[int, ...]) -> None:
        if self._waiting:
            raise RuntimeError("the previous turn has no reply yet")
        self.token_ids.extend(user_message)
        self._waiting = True

    def answer(self, reply_token_ids: tuple[int, ...]) -> None:
        if not self._waiting:
            raise RuntimeError("no turn is waiting for a reply")
        self.token_ids.extend(reply_token_ids)
        self._waiting = False

    def prompt(self) -> list[int]:
        return list(self.token_ids)
