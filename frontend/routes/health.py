"""GET /health: 200 while the gateway can serve (a prefill and a decode worker, not draining).

No API key: load balancers and probes call it. 503 says why in `status`: `no workers` or
`draining` (the gateway is stopping; send elsewhere).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from frontend.routes.state import AdmissionDep, PipelineDep

router = APIRouter()


class HealthStatus(BaseModel):
    """The body of both answers (what the OpenAPI document declares)."""

    status: str = Field(description="`ok`, `no workers` or `draining`")
    prefill_workers: int
    decode_workers: int


_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": HealthStatus, "description": "The gateway can serve"},
    503: {"model": HealthStatus, "description": "It cannot: `status` says why"},
}


@router.get("/health", responses=_RESPONSES)
async def health(pipeline: PipelineDep, admission: AdmissionDep) -> JSONResponse:
    num_prefill = len(pipeline.router.prefill_addresses)
    num_decode = len(pipeline.router.decode_addresses)
    body = {"prefill_workers": num_prefill, "decode_workers": num_decode}
    if not admission.is_open:
        return JSONResponse({"status": "draining", **body}, status_code=503)
    ok = num_prefill > 0 and num_decode > 0
    return JSONResponse({"status": "ok" if ok else "no workers", **body}, status_code=200 if ok else 503)
