"""Decode failover from stored state at the gateway, against fake workers: the lost worker named
where it kept the request's state (`TokenDelta.resume_from`), so the gateway first sends another
decode worker a Decode with that `resume_from` and every token sent; no prefill runs again. When
that worker cannot use the stored state (DATA_LOSS), the gateway re-prefills instead. Either way
the client sees the script once, no token repeated or missing, and the metric says which method."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import httpx

from splitserve.v1 import decode_pb2
from tests.frontend.conftest import MODEL, SCRIPT_TEXT, Gateway, running_gateway
from tests.frontend.fakes import FakeDecode, FakeWorkerServer
from tests.frontend.test_decode_failover import NUM_BEFORE_LOSS, Doomed, _text, stream_with_loss

KEPT_IN = ("127.0.0.1:2", "decode-x/req")  # (store address, state key) the lost worker announces
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 200}


@dataclass
class KeepingDecode(FakeDecode):
    """A fake decode worker that keeps its requests' state: its first delta names where; with
    `refuse_resume`, a Decode with `resume_from` fails as if a stored piece were corrupt."""

    refuse_resume: bool = False
    resumes: list[decode_pb2.DecodeRequest] = field(default_factory=list)  # Decodes with resume_from

    def Decode(self, request, context):  # noqa: N802
        if request.HasField("resume_from"):
            self.resumes.append(request)
            if self.refuse_resume:
                context.abort(grpc.StatusCode.DATA_LOSS, "stored state of the request is corrupt")
            # every token sent is given and the next is output len(sent); the fake streams from
            # 1 + len(output_token_ids), as after a prefill's first token
            given = request
            request = decode_pb2.DecodeRequest()
            request.CopyFrom(given)
            del request.output_token_ids[-1]
        for i, delta in enumerate(super().Decode(request, context)):
            if i == 0:
                delta.resume_from.store_address, delta.resume_from.state_key = KEPT_IN
            yield delta


@contextlib.contextmanager
def doomed_keeping_decode(
    tiny_model_path, script, refuse_resume: bool
) -> Iterator[tuple[Gateway, Doomed, KeepingDecode]]:
    """The gateway, a doomed decode worker that announces `KEPT_IN`, and the worker to fail over
    to (refusing stored-state resumes or not); the router knows only the doomed one until `lose`."""
    doomed = KeepingDecode(script, hang_after=NUM_BEFORE_LOSS)
    healthy = KeepingDecode(script, refuse_resume=refuse_resume)
    servers = [FakeWorkerServer(doomed), FakeWorkerServer(healthy)]
    try:
        with running_gateway(tiny_model_path, script) as gateway:
            gateway.router.update_workers(gateway.router.prefill_addresses, [servers[0].address])
            yield gateway, Doomed(doomed, servers[0], servers[1].address), healthy
    finally:
        for server in servers:
            server.stop()


def _failovers(url: str) -> dict[tuple[str, str], float]:
    """splitserve_decode_failovers_total by (outcome, method)."""
    counts = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("splitserve_decode_failovers_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            method = line.split('method="', 1)[1].split('"', 1)[0]
            counts[(outcome, method)] = float(line.rsplit(" ", 1)[1])
    return counts


def test_a_lost_stream_resumes_from_the_stored_state_without_a_prefill(tiny_model_path, script):
    with doomed_keeping_decode(tiny_model_path, script, refuse_resume=False) as (gateway, doomed, healthy):
        events = stream_with_loss(gateway, doomed, BODY)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events)
        assert _text(events) == SCRIPT_TEXT
        assert len(gateway.prefill.requests) == 1  # the first prefill only
        (resume,) = healthy.resumes
        assert (resume.resume_from.store_address, resume.resume_from.state_key) == KEPT_IN
        assert list(resume.output_token_ids) == script.token_ids[: 1 + NUM_BEFORE_LOSS]
        assert not healthy.reserves
        counts = _failovers(gateway.url)
        assert counts.get(("resumed", "stored_state")) == 1, counts
        assert not any(method == "reprefill" for _, method in counts), counts


def test_a_stored_state_that_cannot_be_used_falls_back_to_reprefill(tiny_model_path, script):
    with doomed_keeping_decode(tiny_model_path, script, refuse_resume=True) as (gateway, doomed, healthy):
        events = stream_with_loss(gateway, doomed, BODY)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events)
        assert _text(events) == SCRIPT_TEXT
        sent = script.token_ids[: 1 + NUM_BEFORE_LOSS]
        assert list(gateway.prefill.requests[-1].output_token_ids) == sent  # re-prefilled
        assert len(healthy.resumes) == 1 and healthy.reserves  # refused, then reserved for the re-prefill
        counts = _failovers(gateway.url)
        # failed: the refusal, and maybe an attempt before the healthy worker was listed
        assert counts.get(("failed", "stored_state"), 0) >= 1, counts
        assert counts.get(("resumed", "reprefill")) == 1, counts
