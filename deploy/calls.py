"""Awaiting a Ray actor call with a deadline, and naming what a failed call raised."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def call(ref: Any, timeout_s: float) -> Any:
    """The result of an actor call (an ObjectRef), or `asyncio.TimeoutError` after `timeout_s`."""
    return await asyncio.wait_for(_awaitable(ref), timeout_s)


def cause(exc: BaseException) -> str:
    """The original error inside a Ray task error, as one line."""
    inner = getattr(exc, "cause", None) or exc
    return f"{type(inner).__name__}: {inner}"


async def _awaitable(ref: Awaitable[Any]) -> Any:
    # asyncio.wait_for wants a coroutine or future; an ObjectRef is only awaitable.
    return await ref
