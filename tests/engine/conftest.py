from __future__ import annotations

import pytest

from splitserve.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """The embedded default preset, built once per test session into a temp folder."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_path):
    from splitserve import LLM

    return LLM(model=str(tiny_model_path), dtype="float32", max_model_len=1024)
