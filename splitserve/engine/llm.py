"""The offline Python API, shaped like vLLM's `LLM`: batch in, `RequestOutput`s out, in order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from splitserve.detokenizer import IncrementalDetokenizer
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.request import Request
from splitserve.engine_config import EngineConfig
from splitserve.outputs import CompletionOutput, RequestOutput
from splitserve.sampling_params import SamplingParams
from splitserve.tokenizer import Tokenizer


class LLM:
    """Runs the engine in-process: `LLM(model=PATH, ...).generate(prompts, sampling_params)`.

    Keyword arguments are `EngineConfig` fields (`tensor_parallel_size=N` starts N - 1 more rank
    processes, ended by `shutdown()` or at exit). Stop strings and text come from the checkpoint's
    tokenizer; a checkpoint without one takes `prompt_token_ids` and returns empty text.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        if model is None:
            from splitserve.default_model import default_model_path

            model = str(default_model_path())
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_kwargs))
        self.tokenizer = Tokenizer.maybe_load(model)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in order; `n` samples of a prompt (its prompt computed
        once) are its `outputs`, by sample index, or with `best_of` the `n` of highest cumulative
        logprob, best first (each keeps its sample index)."""
        texts, id_lists = self._inputs(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(id_lists))
        groups: list[tuple[str, SamplingParams, list[Request]]] = []
        requests: list[Request] = []
        detoks: dict[str, IncrementalDetokenizer] = {}
        try:
            for text, ids, sp in zip(texts, id_lists, params):
                request_id = str(next(self._ids))
                first = self.engine.add_request(request_id, list(ids), sp, prompt=text)
                samples = [first, *first.samples_to_fork]
                groups.append((request_id, sp, samples))
                requests.extend(samples)
                if self.tokenizer is not None:
                    for r in samples:
                        detoks[r.request_id] = IncrementalDetokenizer(
                            self.tokenizer,
                            list(ids),
                            sp.stop,
                            sp.skip_special_tokens,
                            sp.include_stop_str_in_output,
                        )
            self._run(requests, detoks, use_tqdm)
        except BaseException:
            for r in requests:
                self.engine.abort_request(r.request_id)
            raise
        return [self._group_output(request_id, sp, samples, detoks) for request_id, sp, samples in groups]

    def shutdown(self) -> None:
        """End the engine's other ranks (with `tensor_parallel_size` > 1; otherwise nothing to end).
        Dropping the LLM or leaving the interpreter ends them too."""
        self.engine.shutdown()

    def _run(
        self, requests: list[Request], detoks: dict[str, IncrementalDetokenizer], use_tqdm: bool
    ) -> None:
        bar = tqdm(total=len(requests), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests:
            for update in self.engine.step():
                detok = detoks.get(update.request.request_id)
                if detok is not None:
                    detok.push(update.new_token_ids)
                    if detok.stop_reason is not None and not update.finished:
                        self.engine.finish_request(update.request.request_id, "stop", detok.stop_reason)
                if update.request.finished:
                    bar.update(1)
        bar.close()

    def _inputs(
        self, prompts: str | Sequence[str] | None, prompt_token_ids: Sequence[Sequence[int]] | None
    ) -> tuple[list[str | None], list[list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is not None:
            return [None] * len(prompt_token_ids), [list(p) for p in prompt_token_ids]
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json; pass prompt_token_ids instead")
        texts = [prompts] if isinstance(prompts, str) else list(prompts or [])
        for t in texts:
            if not isinstance(t, str) or not t:
                raise ValueError("prompt is empty: send at least one character")
        return list(texts), [self.tokenizer.encode(t) for t in texts]

    @staticmethod
    def _params(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params

    def _output(self, request: Request, detok: IncrementalDetokenizer | None) -> RequestOutput:
        """The output of one request of one sample."""
        detoks = {request.request_id: detok} if detok is not None else {}
        return self._group_output(request.request_id, request.params, [request], detoks)

    def _group_output(
        self,
        request_id: str,
        params: SamplingParams,
        samples: list[Request],
        detoks: dict[str, IncrementalDetokenizer],
    ) -> RequestOutput:
        completions = [self._completion(r, detoks.get(r.request_id)) for r in samples]
        if params.ranks_samples:
            completions.sort(key=lambda c: c.cumulative_logprob or 0.0, reverse=True)
            completions = completions[: params.n]
            if params.logprobs is None:  # drawn for the ranking only
                for c in completions:
                    c.logprobs = None
        first = samples[0]
        return RequestOutput(
            request_id,
            first.prompt,
            first.prompt_token_ids,
            completions,
            True,
            num_cached_tokens=first.num_cached_tokens,
        )

    @staticmethod
    def _completion(request: Request, detok: IncrementalDetokenizer | None) -> CompletionOutput:
        text = ""
        if detok is not None:
            detok.flush()
            text = detok.text
        logprobs = list(request.output_logprobs) if request.params.logprobs is not None else None
        return CompletionOutput(
            index=request.sample_index,
            token_ids=list(request.output_token_ids),
            text=text,
            logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
