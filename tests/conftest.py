"""Fixtures every test package may use: the tiny model's tokenizer files alone (no weights, no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.tokenizer import Tokenizer
from splitserve.tokenizer_files import write_tokenizer_files


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the tiny model's tokenizer.json and chat template."""
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizer_dir)
