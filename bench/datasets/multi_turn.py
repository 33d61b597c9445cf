"""The multi-turn dataset (the agentic pattern) and the conversation each session builds as it runs.

Sessions run concurrently and a session's turns one after another: turn k sends the whole
conversation so far (every earlier user message and the server's actual reply to it) plus the
new user message, so every turn re-sends a growing prefix the server has seen before.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from bench.datasets.base import Dataset, Prompt, Session, Turn
from bench.datasets.config import DatasetConfig
from bench.datasets.prompts import PromptFactory
from bench.tokenizer import BenchTokenizer


def build_multi_turn(config: DatasetConfig, tokenizer: BenchTokenizer | None) -> Dataset:
    """`mt_num_sessions` sessions of `mt_turns` user messages of `mt_user_len` tokens each."""
    if tokenizer is None:
        raise ValueError(
            "the multi-turn dataset sends the server's replies back as text, so it needs a tokenizer: "
            "pass --tokenizer PATH (a folder with tokenizer.json), or a local --model folder that has one"
        )
    sessions = []
    for session_id, messages in enumerate(user_messages(config, tokenizer)):
        turns = tuple(Turn(message, length, config.mt_output_len) for message, length in messages)
        sessions.append(Session(session_id, turns))
    return Dataset(config.name, sessions=tuple(sessions))


def user_messages(config: DatasetConfig, tokenizer: BenchTokenizer | None) -> list[list[tuple[Prompt, int]]]:
    """Per session, its `mt_turns` user messages of `mt_user_len` tokens and their measured lengths:
    text with a tokenizer, else token ids; the same seed gives the same messages."""
    factory = PromptFactory(tokenizer, random.Random(config.seed), config.vocab_size)
    return [
        [factory.prompt(config.mt_user_len) for _ in range(config.mt_turns)]
        for _ in range(config.mt_num_sessions)
    ]


@dataclass
class Conversation:
    """One session's history as it runs: the user messages sent so far and the replies to them.

    `messages()` is the chat form (user and assistant messages alternating); `text()` the
    completions form, every message concatenated in order with nothing between them.
    """

    user_messages: list[str] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)

    def ask(self, user_message: str) -> None:
        if len(self.user_messages) != len(self.replies):
            raise RuntimeError("the previous turn has no reply yet")
        self.user_messages.append(user_message)

    def answer(self, reply: str) -> None:
        if len(self.replies) + 1 != len(self.user_messages):
            raise RuntimeError("no turn is waiting for a reply")
        self.replies.append(reply)

    def messages(self) -> list[dict[str, str]]:
        out = []
        for i, user in enumerate(self.user_messages):
            out.append({"role": "user", "content": user})
            if i < len(self.replies):
                out.append({"role": "assistant", "content": self.replies[i]})
        return out

    def text(self) -> str:
        return "".join(m["content"] for m in self.messages())
