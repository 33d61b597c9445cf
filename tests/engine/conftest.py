from __future__ import annotations

import os
from unittest import mock

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


def pytest_configure(config: pytest.Config) -> None:
    """`SPLITSERVE_TEST_ASYNC_SCHEDULING=1`: every engine the tests build without saying otherwise
    schedules asynchronously (on the CPU it is off by default); how the engine tests run both ways."""
    if os.environ.get("SPLITSERVE_TEST_ASYNC_SCHEDULING") == "1":
        patch = mock.patch(
            "splitserve.engine.llm_engine.async_scheduling",
            lambda engine_config, device: engine_config.async_scheduling is not False,
        )
        patch.start()
        config.add_cleanup(patch.stop)
