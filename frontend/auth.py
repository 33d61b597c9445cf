"""API keys: `Authorization: Bearer <key>` on the OpenAI routes when the settings list keys.

`/health` and `/metrics` never need a key (probes and scrapers call them).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request

from frontend.errors import unauthorized


def api_key_checker(api_keys: tuple[str, ...]) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: a 401 unless the request carries one of `api_keys` (none: no check)."""
    keys = frozenset(api_keys)

    async def check(request: Request) -> None:  # async: FastAPI would run a plain def in a thread pool
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in keys:
            raise unauthorized()

    return check
