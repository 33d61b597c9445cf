"""What routes read from the app: the generation pipeline and the admission gate.

`build_app` stores both on `app.state`; these dependencies hand them to a route. They are
async on purpose: FastAPI runs a plain `def` dependency on a thread pool, a hop per request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from frontend.admission import Admission
from frontend.generate import Pipeline


async def pipeline_of(request: Request) -> Pipeline:
    pipeline: Pipeline = request.app.state.pipeline
    return pipeline


async def admission_of(request: Request) -> Admission:
    admission: Admission = request.app.state.admission
    return admission


PipelineDep = Annotated[Pipeline, Depends(pipeline_of)]
AdmissionDep = Annotated[Admission, Depends(admission_of)]
