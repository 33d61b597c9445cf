"""A checkpoint's tokenizer, loaded without torch: `tokenizer.json` via the `tokenizers` library
and the chat template rendered with jinja2 from `tokenizer_config.json`.

`transformers.AutoTokenizer` would import torch when it is installed, which the GPU-less
frontend must not do (docs/ARCHITECTURE.md, "Pitfalls the code is shaped around").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its `raise_exception`), or the model has none.

    Its message is written for the user, so a server may show it; other errors from rendering
    may carry internal text."""


class Tokenizer:
    """Encodes text, decodes ids, renders chat; promises the same ids as AutoTokenizer."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path).expanduser()
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found; token-id prompts still work without it")
        self._tok = _HFTokenizer.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.special_ids = set(self._tok.get_added_tokens_decoder())
        self._template: jinja2.Template | None = None

    @classmethod
    def maybe_load(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer, or None when the checkpoint ships none (token-id prompts only)."""
        return cls(path) if (Path(path).expanduser() / "tokenizer.json").is_file() else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids `encode` gives, computed with the GIL released, so other Python threads run
        meanwhile (the library's batch path drops the GIL; its single-text path holds it).
        For long texts, called from a worker thread: a 100k-token prompt takes ~0.2 s."""
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model's tokenizer has no chat template; use /v1/completions")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_template_error(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")
