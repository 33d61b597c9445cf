"""ClientWatch (frontend/client_watch.py): a disconnect cuts short guarded work, and only that."""

from __future__ import annotations

import asyncio

import pytest

from frontend.client_watch import ClientWatch


class Client:
    """A `receive` that gives a disconnect once `leave()` is called."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def receive(self) -> dict[str, str]:
        await self.left.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self.left.set()


def test_a_disconnect_ends_the_guarded_work_quietly():
    async def main() -> tuple[bool, bool, bool]:
        client, never = Client(), asyncio.Event()
        watch = ClientWatch(client.receive)
        finished = False
        asyncio.get_running_loop().call_soon(client.leave)
        with watch.guard():
            await never.wait()  # a worker that never answers
            finished = True
        await asyncio.sleep(0)  # the task goes on: the cancellation was the guard's alone
        watch.close()
        task = asyncio.current_task()
        assert task is not None
        return watch.gone, finished, task.cancelling() == 0

    assert asyncio.run(main()) == (True, False, True)


def test_a_cancellation_from_elsewhere_still_cancels():
    async def guarded(watch: ClientWatch, started: asyncio.Event) -> None:
        with watch.guard():
            started.set()
            await asyncio.Event().wait()

    async def main() -> bool:
        client, started = Client(), asyncio.Event()
        watch = ClientWatch(client.receive)
        task = asyncio.ensure_future(guarded(watch, started))
        await started.wait()
        task.cancel()  # the server shutting down
        with pytest.raises(asyncio.CancelledError):
            await task
        watch.close()
        return watch.gone

    assert asyncio.run(main()) is False


def test_a_disconnect_between_guards_is_only_noted():
    async def main() -> tuple[bool, int]:
        client = Client()
        watch = ClientWatch(client.receive)
        with watch.guard():
            await asyncio.sleep(0)
        client.leave()
        for _ in range(10):  # unguarded waits (a release, say): none is cut short
            await asyncio.sleep(0)
        watch.close()
        task = asyncio.current_task()
        assert task is not None
        return watch.gone, task.cancelling()

    assert asyncio.run(main()) == (True, 0)
