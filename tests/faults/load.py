"""A bounded closed-loop load for fault tests: K clients, each sending one streaming completion
after another until stopped, every outcome recorded with when it started and ended.

The load is what makes a fault land on work in flight; the outcomes are what the test checks
(which failed, with what, and whether everything started after the deployment healed succeeded).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Outcome:
    """One request as its client saw it."""

    client: int
    prompt: list[int] | str
    started_s: float  # time.monotonic()
    ended_s: float = 0.0
    status: int = 0  # the HTTP status; 0 when the connection itself failed
    error: str | None = None  # the error body or SSE error event, or the client's exception
    token_ids: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


class ClosedLoopLoad:
    """`num_clients` threads, each looping: pick a prompt, stream a completion, record the outcome.

    `body(client, n)` builds the n-th request body of a client (its prompt and parameters; the
    load adds `stream`, and token ids in logprobs). `stop()` lets every client finish the request
    it is on and returns every outcome, in the order they ended. `uds`: a Unix socket to connect
    through instead of the url's host and port (tests/uds_relay.py)."""

    def __init__(
        self,
        url: str,
        body: Callable[[int, int], dict[str, Any]],
        num_clients: int,
        timeout_s: float = 300.0,
        uds: str | None = None,
    ) -> None:
        self.url = url
        self._uds = uds
        self._body = body
        self._timeout_s = timeout_s
        self._stopping = threading.Event()
        self._lock = threading.Condition()
        self.outcomes: list[Outcome] = []
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"load-{i}", daemon=True)
            for i in range(num_clients)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, client: int) -> None:
        transport = httpx.HTTPTransport(uds=self._uds) if self._uds else None
        with httpx.Client(timeout=self._timeout_s, transport=transport) as http:
            n = 0
            while not self._stopping.is_set():
                outcome = self._one(http, client, n)
                with self._lock:
                    self.outcomes.append(outcome)
                    self._lock.notify_all()
                n += 1

    def _one(self, http: httpx.Client, client: int, n: int) -> Outcome:
        body = {
            **self._body(client, n),
            "stream": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        outcome = Outcome(client=client, prompt=body["prompt"], started_s=time.monotonic())
        try:
            with http.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                outcome.status = response.status_code
                if response.status_code != 200:
                    outcome.error = response.read().decode(errors="replace")
                else:
                    for line in response.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            self._take(outcome, json.loads(line[6:]))
        except httpx.HTTPError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.ended_s = time.monotonic()
        return outcome

    @staticmethod
    def _take(outcome: Outcome, event: dict[str, Any]) -> None:
        if "error" in event:
            outcome.error = json.dumps(event["error"])
            return
        logprobs = event["choices"][0].get("logprobs")
        if logprobs:
            outcome.token_ids += [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]

    def wait_for(
        self, condition: Callable[[list[Outcome]], bool], what: str, timeout_s: float = 180.0
    ) -> None:
        """Until `condition(outcomes so far)` holds; `timeout_s` guards against a hang."""
        with self._lock:
            assert self._lock.wait_for(lambda: condition(self.outcomes), timeout_s), (
                f"never saw {what}; outcomes: {summary(self.outcomes)}"
            )

    def stop(self) -> list[Outcome]:
        self._stopping.set()
        for thread in self._threads:
            thread.join(self._timeout_s)
        assert not any(t.is_alive() for t in self._threads), "a load client hung"
        with self._lock:
            return list(self.outcomes)


def num_ok_since(outcomes: list[Outcome], since_s: float) -> int:
    """Requests that started at or after `since_s` and succeeded."""
    return sum(1 for o in outcomes if o.started_s >= since_s and o.ok)


def summary(outcomes: list[Outcome]) -> dict[str, int]:
    """How many ended each way: "ok", or the status with the start of the error."""
    counts: dict[str, int] = {}
    for o in outcomes:
        key = "ok" if o.ok else f"{o.status}: {(o.error or '')[:160]}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def random_prompts(seed: int, count: int, min_len: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]
