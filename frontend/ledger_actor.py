"""The admission ledger as a Ray actor, and a gateway's client for it over Ray.

`remote_ledger_actor()` wraps `LedgerActor` (an async actor: its methods share one event loop, as
`AdmissionLedger` needs, and a request waiting in its queue is one pending call). The controller
starts one per deployment with several gateway processes, on the head node, and hands each
gateway its handle (`GatewayActor.use_ledger`); a ledger that dies is started again and handed
out again. `RayLedgerClient` is the gateway's side: a call to a dead ledger raises
`LedgerUnavailable`. This module imports ray only inside functions, and never torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from frontend.admission_ledger import AdmissionLedger, Outcome
from frontend.shared_admission import LedgerUnavailable

# The queue's requests are pending calls on the actor: room for a full queue and the rest.
MAX_PENDING_CALLS = 100_000


class LedgerActor:
    """Owns one `AdmissionLedger`; tells each registered gateway of contention through its handle."""

    def __init__(self, max_queued_requests: int, recovering_from: Iterable[int] = ()) -> None:
        self._ledger: AdmissionLedger | None = None
        self._args = (max_queued_requests, tuple(recovering_from))

    @property
    def ledger(self) -> AdmissionLedger:
        if self._ledger is None:  # built on the actor's event loop, where it runs
            self._ledger = AdmissionLedger(*self._args)
        return self._ledger

    async def start(self, host: str | None = None, port: int | None = None) -> str:
        """Ready to serve; returns its epoch's first 12 digits (a controller records them as its
        address: they change when it is started again)."""
        return self.ledger.epoch[:12]

    async def register(self, gateway: int, held_slots: int, gateway_handle: Any = None) -> str:
        notice = None
        if gateway_handle is not None:

            def notice(seq: int, contended: bool) -> None:
                gateway_handle.ledger_notice.remote(seq, contended)

        return self.ledger.register(gateway, held_slots, notice)

    async def forget(self, gateway: int) -> None:
        self.ledger.forget(gateway)

    async def acquire(self, gateway: int, waiter_id: int, num_slots: int) -> Outcome:
        return await self.ledger.acquire(gateway, waiter_id, num_slots)

    async def give_back(self, gateway: int, num_slots: int, reply_to: int = 0) -> None:
        self.ledger.give_back(gateway, num_slots, reply_to)

    async def leave(self, gateway: int, waiter_id: int) -> None:
        self.ledger.leave(gateway, waiter_id)

    async def set_capacity(self, capacity_slots: int | None) -> None:
        self.ledger.set_capacity(capacity_slots)

    async def health(self) -> dict[str, Any]:
        ledger = self.ledger
        return {
            "serving": True,
            "capacity_slots": ledger.capacity_slots,
            "num_lent_slots": ledger.num_lent,
            "lent_slots": {str(g): n for g, n in sorted(ledger.held.items())},
            "num_waiting": ledger.num_waiting,
            "contended": ledger.contended,
        }

    async def stats(self) -> dict[str, Any]:
        return await self.health()

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        return None


def remote_ledger_actor(**ray_options: Any) -> Any:
    """`LedgerActor` as a Ray actor class (no GPU, room for a full queue of pending calls)."""
    import ray

    options = {"num_gpus": 0, "max_concurrency": MAX_PENDING_CALLS, **ray_options}
    return ray.remote(**options)(LedgerActor)


class RayLedgerClient:
    """Gateway `gateway`'s calls to the ledger actor `ledger`; `gateway_handle` is the gateway's own
    actor handle, through which the ledger tells it of contention."""

    def __init__(self, ledger: Any, gateway: int, gateway_handle: Any) -> None:
        self.ledger = ledger
        self.gateway = gateway
        self.gateway_handle = gateway_handle

    async def register(self, held_slots: int) -> None:
        await self._call(self.ledger.register.remote(self.gateway, held_slots, self.gateway_handle))

    async def acquire(self, waiter_id: int, num_slots: int) -> Outcome:
        outcome: Outcome = await self._call(self.ledger.acquire.remote(self.gateway, waiter_id, num_slots))
        return outcome

    def give_back(self, num_slots: int, reply_to: int = 0) -> None:
        self.ledger.give_back.remote(self.gateway, num_slots, reply_to)

    def leave(self, waiter_id: int) -> None:
        self.ledger.leave.remote(self.gateway, waiter_id)

    def set_capacity(self, capacity_slots: int | None) -> None:
        self.ledger.set_capacity.remote(capacity_slots)

    @staticmethod
    async def _call(ref: Any) -> Any:
        import ray

        try:
            return await ref
        except ray.exceptions.RayActorError as exc:
            raise LedgerUnavailable(f"the admission ledger is gone: {exc}") from exc
