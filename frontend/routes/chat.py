"""POST /v1/chat/completions: the messages through the chat template, `n` choices of one prefill."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from frontend.generate import Generation
from frontend.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    DeltaMessage,
)
from frontend.openapi import generation_responses
from frontend.protocol import ChatCompletionRequest
from frontend.responses import TokenRenderer, concat_steps, usage_of
from frontend.routes.generations import generations_for
from frontend.routes.state import PipelineDep
from frontend.serving import serve
from frontend.steps import Step

router = APIRouter()


@router.post("/v1/chat/completions", responses=generation_responses(ChatCompletionResponse))
async def chat_completions(body: ChatCompletionRequest, raw: Request, pipeline: PipelineDep) -> Response:
    request_id, gens = await generations_for(pipeline, body, "chatcmpl")
    renderer = TokenRenderer(pipeline.tokenizer, body.return_tokens_as_token_ids, body.top_logprobs or 0)
    view = ChatView(request_id, pipeline.settings.model_name, gens, renderer)
    return await serve(raw, gens, body.stream, body.include_usage, view)


class ChatView:
    """Renders a chat request's steps: a role chunk first, then a delta per step; or one message."""

    def __init__(
        self, request_id: str, model_name: str, gens: list[Generation], renderer: TokenRenderer
    ) -> None:
        self.request_id = request_id
        self.model_name = model_name
        self.gens = gens
        self.renderer = renderer
        self._sent_role: set[int] = set()  # choices whose role chunk went out

    def chunk(self, index: int, step: Step) -> list[str]:
        out = []
        if index not in self._sent_role:
            self._sent_role.add(index)
            role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            out.append(self._chunk([role]))
        piece = ChatChunkChoice(
            index=index,
            delta=DeltaMessage(content=step.text),
            logprobs=self.renderer.chat_logprobs(step),
            finish_reason=step.finish_reason,
            stop_reason=step.stop_reason,
        )
        out.append(self._chunk([piece]))
        return out

    def whole(self, steps: list[list[Step]]) -> ChatCompletionResponse:
        choices = []
        for index, choice_steps in enumerate(steps):
            step = concat_steps(choice_steps)
            choices.append(
                ChatChoice(
                    index=index,
                    message=ChatMessageOut(content=step.text),
                    logprobs=self.renderer.chat_logprobs(step),
                    finish_reason=step.finish_reason,
                    stop_reason=step.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.request_id, model=self.model_name, choices=choices, usage=usage_of(self.gens)
        )

    def usage_chunk(self) -> str:
        return self._chunk([], with_usage=True)

    def _chunk(self, choices: list[ChatChunkChoice], with_usage: bool = False) -> str:
        usage = usage_of(self.gens) if with_usage else None
        chunk = ChatCompletionChunk(id=self.request_id, model=self.model_name, choices=choices, usage=usage)
        return chunk.model_dump_json()
