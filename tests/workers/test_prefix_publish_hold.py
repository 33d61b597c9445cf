"""A publisher with a hold (a decode worker's `PrefillYield`): nothing reaches the store before
the hold lets it go, a backlog is not held, and a wait that ran out is counted."""

from __future__ import annotations

import threading

from splitserve.prefix_hash import prefix_hash_chain
from splitserve.worker.prefix_store.publisher import PrefixPublisher
from tests.workers.test_prefix_publish_fetch import PROMPT, UNIT, WAIT_S, _retained, served  # noqa: F401


class _Hold:
    """Blocks each publish until the test sets `release`; records the offer times it was given."""

    def __init__(self, answer: bool = True) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.offered_s: list[float] = []
        self.answer = answer

    def __call__(self, offered_s: float) -> bool:
        self.offered_s.append(offered_s)
        self.entered.set()
        assert self.release.wait(WAIT_S)
        return self.answer


def test_a_held_prefix_reaches_the_store_only_once_the_hold_lets_it_go(served) -> None:  # noqa: F811
    store, client = served
    hold = _Hold()
    publisher = PrefixPublisher(client, "decode-a", hold=hold, clock=lambda: 123.0)
    publisher.offer(_retained(2 * UNIT))
    assert hold.entered.wait(WAIT_S)
    assert store.match_prefix(prefix_hash_chain(PROMPT, UNIT)).key is None  # held: not written yet
    assert not publisher.wait_idle(0.0)
    hold.release.set()
    assert publisher.wait_idle(WAIT_S)
    assert store.match_prefix(prefix_hash_chain(PROMPT, UNIT)).num_tokens == 2 * UNIT
    assert hold.offered_s == [123.0]  # the time it was offered, by the publisher's clock
    assert (publisher.stats.num_published, publisher.stats.num_held_past_wait) == (1, 0)
    publisher.close()


def test_prefixes_queued_behind_a_held_one_are_not_held_and_a_wait_that_ran_out_counts(served) -> None:  # noqa: F811
    _, client = served
    hold = _Hold(answer=False)  # as when prompts kept arriving for the whole wait
    publisher = PrefixPublisher(client, "decode-a", max_pending=4, hold=hold)
    publisher.offer(_retained(UNIT, seed=1))
    assert hold.entered.wait(WAIT_S)
    publisher.offer(_retained(2 * UNIT, seed=2))
    publisher.offer(_retained(3 * UNIT, seed=3))
    hold.release.set()
    assert publisher.wait_idle(WAIT_S)
    # the second had the third behind it: published without a hold; the third waited alone
    assert len(hold.offered_s) == 2
    assert (publisher.stats.num_published, publisher.stats.num_held_past_wait) == (3, 2)
    publisher.close()
