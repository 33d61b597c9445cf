"""Owns the model, its cache tensors and the sampler; turns a scheduled step into sampled tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.engine.forward_batch import ForwardBatch, TokenGroup
from splitserve.engine.model.kimi_linear import KimiLinearForCausalLM, LayerCaches
from splitserve.engine.sampler import Sampler, SamplingRow
from splitserve.engine.scheduler import ScheduledRequest
from splitserve.engine.state_transfer import extract_kda, extract_mla_rows, token_rows


@dataclass
class StepResult:
    """Per scheduled request that sampled: the new token and (if asked) its logprobs."""

    token_ids: dict[str, int]
    logprobs: dict[str, dict[int, float]]


class ModelRunner:
    """Builds the flat batch (single-token rows first), runs the model, samples."""

    def __init__(
        self,
        model: KimiLinearForCausalLM,
        caches: LayerCaches,
        sampler: Sampler,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.caches = caches
        self.sampler = sampler
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> StepResult:
        singles = [s for s in scheduled if s.num_new_tokens == 1]
        multis = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = singles + multis
        batch = self.build_batch(singles, multis)
        batch.after_layer = self._exporter([s for s in ordered if s.request.export is not None])
        hidden = self.model(batch, self.caches)
        sampling = [s for s in ordered if s.samples]
        if not sampling:
            return StepResult({}, {})
        logits = self.model.compute_logits(hidden)
        rows = [
            SamplingRow(s.request.params, s.request.prompt_token_ids, s.request.output_token_ids)
            for s in sampling
        ]
        out = self.sampler(logits, rows)
        ids = {s.request.request_id: t for s, t in zip(sampling, out.token_ids)}
        lps: dict[str, dict[int, float]] = {}
        if out.logprobs is not None:
            for s, lp in zip(sampling, out.logprobs):
                if lp is not None:
                    lps[s.request.request_id] = lp
        return StepResult(ids, lps)

    def _exporter(self, exporting: list[ScheduledRequest]) -> Callable[[int], None] | None:
        """After each layer, hand every exporting request its state that this layer made final:
        the MLA rows of the chunk that just ran (every chunk), the KDA states after the last one.

        Only copies are handed over (a gather on the device, never a sync): the export callable
        queues them and encodes and sends them on its own thread.
        """
        if not exporting:
            return None
        jobs = []
        for s in exporting:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            if start <= req.num_cached_tokens:  # first chunk after a prefix hit: ship the hit's rows too
                start = 0
            # The state to ship covers every token known before this sample: the prompt, plus the
            # tokens a resumed request (decode failover) had already generated.
            n = req.num_tokens
            end = min(end, n)
            rows = token_rows(req.block_table, end, self.block_size, start)
            jobs.append((req, rows, start, end, n, s.samples))
        mla = self.caches.mla_kv

        def after_layer(layer_id: int) -> None:
            for req, rows, start, end, n, last in jobs:
                assert req.export is not None and req.state_slot is not None
                if layer_id in mla and end > start:
                    req.export(extract_mla_rows(self.caches, layer_id, rows, start, n))
                elif layer_id not in mla and last:
                    for state in extract_kda(self.caches, layer_id, req.state_slot, n):
                        req.export(state)

        return after_layer

    @torch.inference_mode()
    def chunk_logits(self, chunk: ScheduledRequest) -> torch.Tensor:
        """Logits of every token of one chunk (scoring / prompt logprobs), caches updated as usual."""
        single, multi = ([chunk], []) if chunk.num_new_tokens == 1 else ([], [chunk])
        batch = self.build_batch(single, multi)
        batch.logits_indices = torch.arange(batch.num_tokens, device=self.device)
        return self.model.compute_logits(self.model(batch, self.caches))

    def build_batch(self, singles: list[ScheduledRequest], multis: list[ScheduledRequest]) -> ForwardBatch:
        input_ids: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        bs = self.block_size
        for s in singles + multis:
            req, start = s.request, s.request.num_computed_tokens
            for pos in range(start, start + s.num_new_tokens):
                input_ids.append(req.token_at(pos))
                slot_mapping.append(req.block_table[pos // bs] * bs + pos % bs)
            if s.samples:
                logits_indices.append(len(input_ids) - 1)
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            single=self._group(singles, 0) if singles else None,
            multi=self._group(multis, len(singles)) if multis else None,
        )

    def _group(self, rows: list[ScheduledRequest], offset: int) -> TokenGroup:
        dev, bs = self.device, self.block_size
        lengths = [s.num_new_tokens for s in rows]
        computed = torch.tensor([s.request.num_computed_tokens for s in rows], dtype=torch.long)
        max_len = max(lengths)
        starts = torch.tensor([0, *lengths[:-1]], dtype=torch.long).cumsum(0) + offset
        steps = torch.arange(max_len, dtype=torch.long)
        len_t = torch.tensor(lengths, dtype=torch.long)
        valid = steps.unsqueeze(0) < len_t.unsqueeze(1)
        token_index = torch.where(valid, starts.unsqueeze(1) + steps, 0)
        ctx_lens = computed + len_t
        max_ctx = int(ctx_lens.max())
        max_blocks = -(-max_ctx // bs)
        tables = torch.zeros(len(rows), max_blocks, dtype=torch.long)
        for i, s in enumerate(rows):
            table = s.request.block_table[:max_blocks]
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
        positions = torch.arange(max_ctx, dtype=torch.long)
        kv_index = tables[:, positions // bs] * bs + positions % bs
        query_pos = computed.unsqueeze(1) + steps  # absolute position of each new token
        return TokenGroup(
            token_index=token_index.to(dev),
            valid=valid.to(dev),
            lengths=lengths,
            state_slots=torch.tensor([s.request.state_slot for s in rows], dtype=torch.long, device=dev),
            kv_index=kv_index.to(dev),
            query_pos=query_pos.to(dev),
            slot_ids=[s.request.state_slot or 0 for s in rows],  # never None: state_slots holds them too
        )
