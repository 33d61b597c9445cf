"""A worker process shortens its GIL switch interval, so its engine thread wins the GIL back
quickly from the gRPC and transfer threads (splitserve/worker/actor_base.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from splitserve.worker.actor_base import GIL_SWITCH_INTERVAL_S, prefer_the_engine_thread


@pytest.fixture
def restore_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_the_default_interval_is_shortened(restore_interval: None) -> None:
    sys.setswitchinterval(0.005)  # Python's default
    prefer_the_engine_thread()
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
    assert GIL_SWITCH_INTERVAL_S < 0.005


def test_a_shorter_interval_already_set_is_kept(restore_interval: None) -> None:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S / 4)
    prefer_the_engine_thread()
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S / 4)
