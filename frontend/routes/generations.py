"""What completions and chat share before any worker is touched: the model check, the prompts'
token ids, the sampling params and one `Generation` per prompt, or per sample of it (n, best_of)."""

from __future__ import annotations

import time
import uuid

from frontend.generate import Generation, Pipeline
from frontend.inputs import check_model, prompt_ids, sampling_params_for
from frontend.protocol import ChatCompletionRequest, CompletionRequest
from frontend.samples import SampleGroup, SharedPrefill


async def generations_for(
    pipeline: Pipeline, body: CompletionRequest | ChatCompletionRequest, id_prefix: str
) -> tuple[str, list[Generation]]:
    """The response id and the request's generations, not yet started; a GatewayError (400/404)
    for anything wrong with the request. Call it first: the request's clock starts here."""
    arrival_s = time.monotonic()
    check_model(body.model, pipeline.settings.model_name)
    prompts = await prompt_ids(body, pipeline.tokenizer, pipeline.settings.prompt_chars_limit)
    params = sampling_params_for(body, prompts, pipeline.settings.max_model_len, pipeline.tokenizer)
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    gens: list[Generation] = []
    for i, ids in enumerate(prompts):
        if params.num_samples == 1:
            gens.append(Generation(pipeline, f"{request_id}-{i}", ids, params, arrival_s))
        else:  # n (best_of) choices of one prefill, in order: prompt-major, then sample index
            leader = SharedPrefill(pipeline, f"{request_id}-{i}", ids, params, arrival_s, counted=False)
            gens.extend(SampleGroup(leader).samples)
    return request_id, gens
