"""GET /health: 200 while the gateway can serve a request, 503 while it cannot.

No API key: load balancers and probes call it. `status` is `ok` (everything can take work),
`degraded` (200: serving without some workers, or through `prefill.fallback: decode_local`;
503: no decode worker can take a request, or no prefill worker and the fallback is `fail`),
`no workers` (503: a pool is empty) or `draining` (503: the gateway is stopping; send
elsewhere). `problems` says what is wrong, one line each (frontend/health_report.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from frontend.health_report import health_report
from frontend.routes.state import AdmissionDep, PipelineDep

router = APIRouter()


class HealthStatus(BaseModel):
    """The body of both answers (what the OpenAPI document declares)."""

    status: str = Field(description="`ok`, `degraded`, `no workers` or `draining`")
    prefill_workers: int = Field(description="prefill workers that can take a prompt now")
    decode_workers: int = Field(description="decode workers that can take a request now")
    problems: list[str] = Field(description="what is wrong, one line each; empty when `ok`")


_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": HealthStatus, "description": "The gateway can serve (`ok`, or `degraded`)"},
    503: {"model": HealthStatus, "description": "It cannot: `status` and `problems` say why"},
}


@router.get("/health", responses=_RESPONSES)
async def health(request: Request, pipeline: PipelineDep, admission: AdmissionDep) -> JSONResponse:
    monitor = request.app.state.monitor
    routes = pipeline.router
    report = health_report(
        routes.prefill_addresses,
        routes.decode_addresses,
        routes.unreachable(),
        monitor.idle_held_slots,
        monitor.full,
        pipeline.settings.prefill_fallback,
        draining=not admission.is_open,
    )
    body = {
        "status": report.status,
        "prefill_workers": report.prefill_workers,
        "decode_workers": report.decode_workers,
        "problems": report.problems,
    }
    return JSONResponse(body, status_code=200 if report.serving else 503)
