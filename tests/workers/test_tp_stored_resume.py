"""Stored-state failover across tensor-parallel widths, over real gRPC: a decode worker process with
`replay_window` publishes every window to its node's store, is SIGKILLed mid-stream, and a decode
worker of another width resumes from what it stored with exactly the offline engine's tokens.

* a width-2 decode worker (prefill at 1): its stored KDA parts hold one piece per rank naming its
  heads; a width-1 worker assembles them;
* a width-1 decode worker, the prefill at 2 (its base state is the prefill's head-ranged pieces): a
  width-2 worker resumes, its rank 0 re-sharding the rebuilt state to its other rank.

Helpers and the lost worker's process are test_stored_resume.py's; float32 throughout, so the
widths' sums agree with the offline engine's token for token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from decode_worker.actor import DecodeWorkerActor
from decode_worker.stored_resume import read_stored_state
from prefill_worker.actor import PrefillWorkerActor
from splitserve import LLM
from splitserve.engine.replay_codec import kda_key
from splitserve.state import StateKind
from splitserve.v1 import decode_pb2
from tests.workers.test_stored_resume import (
    GREEDY,
    PROMPT,
    WINDOW,
    _assert_store_empty,
    _decode_process,
    _kill_after,
    _resume_on_b,
    _store,
)


@pytest.fixture(scope="module")
def fp32(engine_config):
    return engine_config.replace(dtype="float32")


@pytest.fixture(scope="module")
def offline(fp32) -> list[int]:
    """The uninterrupted run's tokens, from the offline engine at width 1."""
    (output,) = LLM(model=fp32.model, max_model_len=512, dtype="float32").generate(
        prompt_token_ids=[PROMPT], sampling_params=GREEDY
    )
    return output.outputs[0].token_ids


@pytest.fixture
def workers(request, fp32, store_server) -> Iterator[dict[str, Any]]:
    """A prefill worker at width `prefill_tp` and the resuming decode worker b at `resume_tp`
    (with `replay_window`, as a pool's workers are), on one store."""
    prefill_tp, resume_tp = request.param
    workers: dict[str, Any] = {
        "prefill": PrefillWorkerActor(fp32.replace(tensor_parallel_size=prefill_tp), store_server[1]),
        "b": DecodeWorkerActor(
            fp32.replace(replay_window=WINDOW, tensor_parallel_size=resume_tp), store_server[1]
        ),
    }
    try:
        for name, worker in workers.items():
            worker.worker_id = f"{name}-tp{prefill_tp}{resume_tp}"
            worker.start("127.0.0.1", 0)
        yield workers
    finally:
        for worker in workers.values():
            worker.shutdown()


@pytest.mark.parametrize(
    "workers,killed_tp",
    [((1, 1), 2), ((2, 2), 1)],
    ids=["killed-tp2-resumed-tp1", "prefill-tp2-killed-tp1-resumed-tp2"],
    indirect=["workers"],
)
def test_a_killed_decode_worker_is_resumed_from_stored_state_at_another_width(
    workers, store_server, fp32, offline, killed_tp
):
    rid = f"tp-stored-{killed_tp}"
    address = store_server[1]
    with _decode_process(fp32.replace(tensor_parallel_size=killed_tp), address) as killed:
        sent, where = _kill_after(workers, killed, address, rid, GREEDY)
    assert sent == offline[: len(sent)]
    n = len(PROMPT)
    with _store(store_server) as client:
        info = client.lookup(kda_key(where.state_key, n + WINDOW))  # the lost worker's second piece
        assert info is not None
        recurrent = {c.heads for c in info.chunks if c.kind is StateKind.KDA_RECURRENT}
        assert len(recurrent) == killed_tp  # one piece per rank, each naming its heads
        found = read_stored_state(client, where.state_key, rid, n, len(sent), 10)
        assert found.num_pieces >= 2
        assert n + len(sent) - WINDOW <= found.num_tokens < n + len(sent)
    deltas: list[decode_pb2.TokenDelta] = _resume_on_b(workers, rid, GREEDY, sent, where)
    assert sent + [t for d in deltas for t in d.token_ids] == offline
    assert deltas[0].resume_from.state_key == f"{workers['b'].worker_id}/{rid}"  # b keeps it now
    _assert_store_empty(workers, store_server)
