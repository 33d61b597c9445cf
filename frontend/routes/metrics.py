"""GET /metrics: the gateway's Prometheus text (no API key, as scrapers expect)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse

from frontend.routes.state import PipelineDep

router = APIRouter()


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(pipeline: PipelineDep) -> Response:
    gauges = pipeline.metrics
    gauges.set_workers(len(pipeline.router.prefill_addresses), len(pipeline.router.decode_addresses))
    return Response(gauges.render(), media_type=gauges.content_type)
