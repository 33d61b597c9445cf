"""The tiny model's tokenizer: a byte-level BPE trained on a corpus that ships in the repo.

`write_tokenizer_files(dir)` writes the three files a Hugging Face checkpoint carries
(`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`). Training is deterministic:
the same corpus and vocabulary size give a byte-identical `tokenizer.json` every time. This module
imports only `tokenizers`, never torch, so torch-free components may use it.

The chat format follows Kimi's: every message is
`<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>`, and `<|im_end|>` doubles as the end of
sequence token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS_PATH = Path(__file__).parent / "data" / "tiny_corpus.txt"
DEFAULT_VOCAB_SIZE = 2048
DEFAULT_MODEL_MAX_LENGTH = 4096

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|im_end|>"
# Order fixes the ids: pad 0, bos 1, im_end (eos) 2, then the chat markers.
SPECIAL_TOKENS = (
    PAD_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
)

# Whitespace control on every tag, so the template renders the same under transformers'
# environment (trim_blocks, lstrip_blocks) and under a plain `jinja2.Environment()`.
# Roles other than user and assistant (system, tool, ...) use the system marker, as Kimi's does.
# Content may be a string or a list of OpenAI-style parts; only the text parts are rendered.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>"
    "{%- endif -%}"
    "{{- message['role'] -}}<|im_middle|>"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, corpus_path: Path = CORPUS_PATH) -> Tokenizer:
    """Train the byte-level BPE on `corpus_path`; `vocab_size` counts the special tokens too."""
    min_vocab_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the 256 byte symbols and {len(SPECIAL_TOKENS)} "
            f"special tokens alone need {min_vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus_path.read_text(encoding="utf-8")
    # One paragraph per training sequence; the order is fixed, which keeps training repeatable.
    tokenizer.train_from_iterator(text.split("\n\n"), trainer=trainer)
    return tokenizer


def tokenizer_config(model_max_length: int = DEFAULT_MODEL_MAX_LENGTH) -> dict[str, Any]:
    """The `tokenizer_config.json` contents that `transformers.AutoTokenizer` reads."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_files(
    path: str | Path,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> Tokenizer:
    """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` into `path`.

    Returns the trained tokenizer, whose `get_vocab_size()` is the model's `vocab_size`.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.save(str(path / "tokenizer.json"))
    special_tokens_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
    }
    _write_json(path / "tokenizer_config.json", tokenizer_config(model_max_length))
    _write_json(path / "special_tokens_map.json", special_tokens_map)
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Ids of pad, bos and eos, keyed the way `KimiLinearConfig` names them."""
    ids = {}
    for key, token in (("pad_token_id", PAD_TOKEN), ("bos_token_id", BOS_TOKEN), ("eos_token_id", EOS_TOKEN)):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {token!r} token; was it built by build_tokenizer()?")
        ids[key] = token_id
    return ids


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
