"""The shapes a benchmark workload takes: single-turn requests, or multi-turn sessions."""

from __future__ import annotations

from dataclasses import dataclass

# A text prompt, or token ids (sent as a list of ints to the completions endpoint).
Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class BenchRequest:
    """One single-turn request: the prompt, its length in tokens and how many tokens to ask for.

    `system_prompt` is the leading part of a text `prompt` that other requests share (empty when
    none): the chat endpoint sends it as a system message and the rest as the user message, the
    completions endpoint sends `prompt` whole. `group_id` names the shared-prefix group.
    """

    prompt: Prompt
    prompt_len: int
    output_len: int
    system_prompt: str = ""
    group_id: int | None = None

    def messages(self) -> list[dict[str, str]]:
        """The prompt as chat messages; only text prompts have them."""
        if not isinstance(self.prompt, str):
            raise ValueError("a token-id prompt cannot be sent as chat messages; pass --tokenizer")
        if not self.system_prompt:
            return [{"role": "user", "content": self.prompt}]
        user = self.prompt[len(self.system_prompt) :]
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]


@dataclass(frozen=True)
class Turn:
    """One user turn of a session: the new user message, its length in tokens, the reply's.

    A text message is sent inside the conversation's text; token ids (multi-turn-ids) inside its
    token ids, with the replies as the token ids the server generated.
    """

    user_message: Prompt
    user_len: int
    output_len: int


@dataclass(frozen=True)
class Session:
    """A conversation whose turns are sent one after another, each carrying all before it."""

    session_id: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Dataset:
    """A whole workload: either single-turn `requests` or multi-turn `sessions`, never both."""

    name: str
    requests: tuple[BenchRequest, ...] = ()
    sessions: tuple[Session, ...] = ()

    def __post_init__(self) -> None:
        if self.requests and self.sessions:
            raise ValueError("a dataset holds single-turn requests or sessions, not both")

    @property
    def num_requests(self) -> int:
        """How many HTTP requests the workload sends (every turn of every session counts)."""
        return len(self.requests) + sum(len(s.turns) for s in self.sessions)

    @property
    def is_multi_turn(self) -> bool:
        return bool(self.sessions)
