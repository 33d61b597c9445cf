"""GET /v1/models: the one model this gateway serves, with its context length."""

from __future__ import annotations

from fastapi import APIRouter

from frontend.openai_responses import ModelCard, ModelList
from frontend.openapi import error_responses
from frontend.routes.state import PipelineDep

router = APIRouter()


@router.get("/v1/models", responses=error_responses(401))
async def models(pipeline: PipelineDep) -> ModelList:
    settings = pipeline.settings
    card = ModelCard(id=settings.model_name, root=settings.model_path, max_model_len=settings.max_model_len)
    return ModelList(data=[card])
