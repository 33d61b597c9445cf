"""The tokenizer a benchmark counts and builds prompts with: what it must offer, and where it comes from."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class BenchTokenizer(Protocol):
    """What datasets and the runner need of a tokenizer; `splitserve.tokenizer.Tokenizer` has it."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_ids(self) -> set[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


def resolve_tokenizer(tokenizer: str | None, model: str) -> BenchTokenizer | None:
    """Load `tokenizer` (a folder with tokenizer.json); without one, `model` if it is such a folder.

    Returns None when neither names a local tokenizer: prompts are then token ids.
    """
    from splitserve.tokenizer import Tokenizer

    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {tokenizer}: no tokenizer.json there; pass a folder that has one")
        return Tokenizer(path)
    path = Path(model).expanduser()
    return Tokenizer(path) if (path / "tokenizer.json").is_file() else None
