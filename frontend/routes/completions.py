"""POST /v1/completions: `n` choices per prompt (one prefill each), all run at once, whole or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from frontend.generate import Generation
from frontend.openai_responses import CompletionChoice, CompletionResponse
from frontend.openapi import generation_responses
from frontend.protocol import CompletionRequest
from frontend.responses import TokenRenderer, best_choices, usage_of
from frontend.routes.generations import generations_for
from frontend.routes.state import PipelineDep
from frontend.serving import serve
from frontend.steps import Step

router = APIRouter()


@router.post("/v1/completions", responses=generation_responses(CompletionResponse))
async def completions(body: CompletionRequest, raw: Request, pipeline: PipelineDep) -> Response:
    request_id, gens = await generations_for(pipeline, body, "cmpl")
    renderers = [TokenRenderer(pipeline.tokenizer, body.return_tokens_as_token_ids, 0) for _ in gens]
    view = CompletionView(
        request_id,
        pipeline.settings.model_name,
        gens,
        renderers,
        ranked=(body.n, body.best_of or body.n, body.logprobs is not None),
    )
    return await serve(raw, gens, body.stream, body.include_usage, view)


class CompletionView:
    """Renders a completions request's steps: a chunk per step, or one whole response.

    One `TokenRenderer` per choice, as each keeps its own text offset for logprobs. The choices
    are the generations in order (prompt-major, `n` samples each); with `best_of` > n (never
    streamed) each prompt's best `n` of its `num_samples` (`ranked`: n, num_samples, whether the
    client asked for logprobs)."""

    def __init__(
        self,
        request_id: str,
        model_name: str,
        gens: list[Generation],
        renderers: list[TokenRenderer],
        ranked: tuple[int, int, bool] = (1, 1, True),
    ) -> None:
        self.request_id = request_id
        self.model_name = model_name
        self.gens = gens
        self.renderers = renderers
        self.n, self.num_samples, self.keep_logprobs = ranked

    def chunk(self, index: int, step: Step) -> list[str]:
        return [self._response([self._choice(index, step)]).model_dump_json()]

    def whole(self, steps: list[list[Step]]) -> CompletionResponse:
        chosen = best_choices(steps, self.n, self.num_samples, self.keep_logprobs)
        choices = [self._choice(i, step) for i, step in enumerate(chosen)]
        return self._response(choices, with_usage=True)

    def usage_chunk(self) -> str:
        return self._response([], with_usage=True).model_dump_json()

    def _choice(self, index: int, step: Step) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=step.text,
            logprobs=self.renderers[index].completion_logprobs(step),
            finish_reason=step.finish_reason,
            stop_reason=step.stop_reason,
        )

    def _response(self, choices: list[CompletionChoice], with_usage: bool = False) -> CompletionResponse:
        usage = usage_of(self.gens) if with_usage else None
        return CompletionResponse(id=self.request_id, model=self.model_name, choices=choices, usage=usage)
