"""Owns the model, its cache tensors and the sampler; turns a scheduled step into sampled tokens."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.engine.cuda_graph import DecodeGraphs
from splitserve.engine.cuda_graph_plan import DecodePadding
from splitserve.engine.forward_batch import ForwardBatch, TokenGroup
from splitserve.engine.host_pack import HostPack, block_tables, long_tensor
from splitserve.engine.host_staging import device_tensor, to_device
from splitserve.engine.model.kimi_linear import KimiLinearForCausalLM, LayerCaches
from splitserve.engine.parallel.group import SINGLE, TensorParallel
from splitserve.engine.pending_inputs import PendingInputs
from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler, SamplerOutput, SamplingRow
from splitserve.engine.scheduler import ScheduledRequest
from splitserve.engine.state_transfer import extract_kda, extract_mla_rows, token_rows

logger = logging.getLogger(__name__)


class StepResult:
    """Per request that sampled in one step: the new token and (if asked) its logprobs.

    `sampled` (the ids, one per entry of `request_ids`, in order) stays on the device, where the next
    step's inputs can take them; `token_ids` and `logprobs` read them on the host when first asked
    (sampler_output.py: one asynchronous copy, waited for then, not inside the step).
    """

    def __init__(self, request_ids: list[str], output: SamplerOutput | None) -> None:
        self.request_ids = request_ids
        self.rows = {rid: i for i, rid in enumerate(request_ids)}  # row of each request in `sampled`
        self._output = output
        self._token_ids: dict[str, int] | None = None
        self._logprobs: dict[str, dict[int, float]] = {}

    @property
    def sampled(self) -> torch.Tensor | None:
        return None if self._output is None else self._output.sampled

    def ready(self) -> bool:
        """Whether reading `token_ids` now would not wait for the device."""
        return self._output is None or self._output.ready()

    @property
    def token_ids(self) -> dict[str, int]:
        if self._token_ids is None:
            self._read()
        assert self._token_ids is not None
        return self._token_ids

    @property
    def logprobs(self) -> dict[str, dict[int, float]]:
        if self._token_ids is None:
            self._read()
        return self._logprobs

    def _read(self) -> None:
        if self._output is None:
            self._token_ids = {}
            return
        self._token_ids = dict(zip(self.request_ids, self._output.token_ids))
        for rid, lp in zip(self.request_ids, self._output.logprobs or []):
            if lp is not None:
                self._logprobs[rid] = lp


class ModelRunner:
    """Builds the flat batch (single-token rows first), runs the model, samples.

    With a `DecodePadding`, single-token rows are padded up to their batch-size bucket (rows on the
    scratch KV row and state slot that sample nothing); with CUDA graphs, a step of single-token
    rows only (no prefill chunk, no export) replays its bucket's graph instead of the eager forward.
    """

    def __init__(
        self,
        model: KimiLinearForCausalLM,
        caches: LayerCaches,
        sampler: Sampler,
        block_size: int,
        device: torch.device,
        padding: DecodePadding | None = None,
        max_model_len: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.model = model
        self.tp = tp
        self.caches = caches
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.padding = padding
        self.graphs: DecodeGraphs | None = None
        if padding is not None and padding.use_graphs:
            if max_model_len is None:
                raise ValueError("CUDA graphs need max_model_len: their KV index is that wide")
            self.graphs = DecodeGraphs(model, caches, padding, block_size, max_model_len, device)
            try:
                self.graphs.capture()
            except Exception:
                # an op that cannot be captured (a kernel package's host sync, say) costs decode
                # speed, not the engine: log it and run every step eagerly, unpadded, as before
                logger.exception("capturing decode CUDA graphs failed; decode runs eagerly")
                self.graphs, self.padding = None, None

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], previous: StepResult | None = None) -> StepResult:
        """Queue one step on the device and return its result, whose ids stay there until read.

        `previous` is the last step's result: a decode row whose input token is one it sampled and
        the host has not read (`Request.num_pending_tokens`, async scheduling) takes it on the device.
        """
        singles = [s for s in scheduled if s.num_new_tokens == 1]
        multis = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = singles + multis
        sampling = [s for s in ordered if s.samples]
        exporting = [s for s in ordered if s.request.export is not None]
        pending = _pending_inputs(singles, previous)
        bucket = self.padding.bucket(len(singles)) if self.padding is not None and singles else None
        if bucket is not None and self.graphs is not None and not multis and not exporting:
            hidden = self.graphs.run([s.request for s in singles], bucket, pending)
            if len(sampling) < len(singles):  # a one-token prompt chunk that is not its prompt's last
                sample_rows = [i for i, s in enumerate(singles) if s.samples]
                hidden = hidden[device_tensor(sample_rows, torch.long, self.device)]
        else:
            num_padding = 0 if bucket is None else bucket - len(singles)
            batch = self.build_batch(singles, multis, num_padding, pending)
            batch.after_layer = self._exporter(exporting)
            hidden = self.model(batch, self.caches)
        if not sampling:
            return StepResult([], None)
        # the other samples of a request draw their first token from its row (parallel_sampling.py)
        drawing = [(i, s.request) for i, s in enumerate(sampling)]
        drawing += [
            (i, r) for i, s in enumerate(sampling) for r in s.request.samples_to_fork if not r.finished
        ]
        if self.tp.size > 1:
            return self._sample_on_first_rank(drawing, len(sampling), hidden)
        rows = _sampling_rows(drawing)
        self.sampler.prepare(rows)  # seeded rows' host-drawn noise, while the forward runs on the device
        logits = _drawn_logits(self.model.compute_logits(hidden), drawing, len(sampling))
        return StepResult([r.request_id for _, r in drawing], self.sampler(logits, rows))

    def _sample_on_first_rank(
        self, drawing: list[tuple[int, Request]], num_sampling: int, hidden: torch.Tensor
    ) -> StepResult:
        """Tensor parallel: each rank's slice of the vocabulary's logits is gathered on rank 0, which
        samples; every rank gets the tokens (its scheduler moves on and its samples fork with them),
        rank 0 the logprobs. Rank 0 reads its sampled ids back to broadcast them: a tensor-parallel
        step keeps that one host sync."""
        logits = self.tp.gather_last_dim(self.model.compute_logits(hidden))
        out = None
        if logits is not None:
            rows = _sampling_rows(drawing)
            self.sampler.prepare(rows)
            out = self.sampler(_drawn_logits(logits, drawing, num_sampling), rows)
        token_ids = self.tp.broadcast_ids(out.token_ids if out else None, len(drawing), self.device)
        return StepResult([r.request_id for _, r in drawing], out or SamplerOutput(token_ids))

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
            if start <= req.num_reused_tokens:  # first chunk after a prefix hit: ship the hit's rows too
                start = 0
            # The state to ship covers every token known before this sample: the prompt, plus the
            # tokens a resumed request (decode failover) had already generated.
            n = req.num_tokens
            end = min(end, n)
            # on the device once (pinned, no stream sync), not from pageable memory per layer
            rows = to_device(token_rows(req.block_table, end, self.block_size, start), self.device)
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
    def chunk_logits(self, chunk: ScheduledRequest) -> torch.Tensor | None:
        """Logits of every token of one chunk (scoring / prompt logprobs), caches updated as usual
        (None on a tensor-parallel rank but the first: rank 0 gathers them)."""
        single, multi = ([chunk], []) if chunk.num_new_tokens == 1 else ([], [chunk])
        batch = self.build_batch(single, multi)
        batch.logits_indices = torch.arange(batch.num_tokens, device=self.device)
        logits = self.model.compute_logits(self.model(batch, self.caches))
        return logits if self.tp.size == 1 else self.tp.gather_last_dim(logits)

    def build_batch(
        self,
        singles: list[ScheduledRequest],
        multis: list[ScheduledRequest],
        num_padding: int = 0,
        pending: PendingInputs | None = None,
    ) -> ForwardBatch:
        """The flat batch: `singles`, then `num_padding` padding rows (token 0 at position 0 on the
        scratch KV row and state slot; they sample nothing), then `multis`. `pending` names the single
        rows whose input id is the last step's sample, taken on the device.

        Host work is per row, not per token (a prompt chunk's ids are one list slice, its KV rows
        one vectorised lookup), and every index goes to the device in one copy (`HostPack`); the
        context's KV rows are expanded from the block tables there, not on the host.
        """
        rows = [_Row.of(s) for s in singles]
        if num_padding:
            assert self.padding is not None, "padding rows need the scratch row and slot"
            pad = _Row(0, 1, [self.padding.scratch_block], self.padding.scratch_slot, None, False)
            rows += [pad] * num_padding
        multi_rows = [_Row.of(s) for s in multis]
        input_ids: list[int] = []
        slot_mapping: list[torch.Tensor] = []
        logits_indices: list[int] = []
        for row in rows + multi_rows:
            input_ids += row.token_ids()
            slot_mapping.append(row.kv_rows(self.block_size))
            if row.samples:
                logits_indices.append(len(input_ids) - 1)
        pack = HostPack()
        flat = [
            pack.add(long_tensor(input_ids)),
            pack.add(torch.cat(slot_mapping)),
            pack.add(long_tensor(logits_indices)),
        ]
        replay = self.caches.replay
        counts = (
            None if replay is None else [0 if r.request is None else replay.pending(r.slot) for r in rows]
        )
        single = self._group(rows, 0, pack, counts) if rows else None
        multi = self._group(multi_rows, len(rows), pack) if multi_rows else None
        pending_ids = None if pending is None else pending.queue(pack)
        pack.to(self.device)
        batch = ForwardBatch(*(pack.get(i) for i in flat), single=None, multi=None)
        if pending is not None and pending_ids is not None:
            pending.fill(pack, pending_ids, batch.input_ids)
        batch.single = single.build(pack) if single is not None else None
        batch.multi = multi.build(pack) if multi is not None else None
        return batch

    def _group(
        self, rows: list[_Row], offset: int, pack: HostPack, replay_counts: list[int] | None = None
    ) -> _GroupPlan:
        """Queue one token group's host integers (per row, the block tables, the ReplaySSM record
        counts of a decode group) into `pack`."""
        lengths = [r.num_new for r in rows]
        computed = [r.num_computed for r in rows]
        starts = list(itertools.accumulate(lengths[:-1], initial=offset))
        max_len = max(lengths)
        max_ctx = max(c + n for c, n in zip(computed, lengths))
        max_blocks = -(-max_ctx // self.block_size)
        tables = block_tables([r.block_table for r in rows], max_blocks)  # zeros: padding blocks
        slot_ids = [r.slot for r in rows]
        per_row = pack.add(long_tensor(computed + lengths + starts + slot_ids))
        table_id = pack.add(tables)
        valid_id = None
        if any(n != max_len for n in lengths):  # the real tokens' flat positions, for gathers without a mask
            valid = itertools.chain.from_iterable(
                range(b * max_len, b * max_len + n) for b, n in enumerate(lengths)
            )
            valid_id = pack.add(long_tensor(list(valid)))
        counts_id = None if replay_counts is None else pack.add(long_tensor(replay_counts))
        return _GroupPlan(
            lengths,
            starts,
            slot_ids,
            max_len,
            max_ctx,
            max_blocks,
            self.block_size,
            per_row,
            table_id,
            valid_id,
            counts_id,
        )


def _sampling_rows(drawing: list[tuple[int, Request]]) -> list[SamplingRow]:
    return [
        SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.num_pending_tokens)
        for _, r in drawing
    ]


def _drawn_logits(
    logits: torch.Tensor, drawing: list[tuple[int, Request]], num_sampling: int
) -> torch.Tensor:
    """One logits row per drawing request (the `num_sampling` scheduled ones first): a prompt's row
    repeated for its samples that fork (the index goes to the device without a stream sync)."""
    if len(drawing) == num_sampling:
        return logits
    return logits[device_tensor([i for i, _ in drawing], torch.long, logits.device)]


def _pending_inputs(singles: list[ScheduledRequest], previous: StepResult | None) -> PendingInputs | None:
    """The single rows whose input token the last step sampled and the host has not read yet."""
    rows, sources = [], []
    for i, s in enumerate(singles):
        request = s.request
        if request.num_computed_tokens >= request.num_known_tokens:
            assert previous is not None and request.request_id in previous.rows, (
                f"{request.request_id}'s input token is pending but the last step did not sample it"
            )
            rows.append(i)
            sources.append(previous.rows[request.request_id])
    if not rows:
        return None
    assert previous is not None and previous.sampled is not None
    return PendingInputs(rows, sources, previous.sampled)


@dataclass
class _GroupPlan:
    """A token group whose host integers wait in a `HostPack`; `build` derives the rest on the device."""

    lengths: list[int]
    starts: list[int]
    slot_ids: list[int]
    max_len: int
    max_ctx: int
    max_blocks: int
    block_size: int
    per_row_id: int
    tables_id: int
    valid_id: int | None
    replay_counts_id: int | None = None

    def build(self, pack: HostPack) -> TokenGroup:
        num_rows, bs = len(self.lengths), self.block_size
        computed, len_t, starts, slots = pack.get(self.per_row_id).view(4, num_rows)
        tables = pack.get(self.tables_id).view(num_rows, self.max_blocks)
        dev = tables.device
        steps = torch.arange(self.max_len, dtype=torch.long, device=dev)
        valid = steps.unsqueeze(0) < len_t.unsqueeze(1)
        token_index = torch.where(valid, starts.unsqueeze(1) + steps, 0)
        positions = torch.arange(self.max_ctx, dtype=torch.long, device=dev)
        kv_index = tables[:, positions // bs] * bs + positions % bs
        return TokenGroup(
            token_index=token_index,
            valid=valid,
            lengths=self.lengths,
            state_slots=slots,
            kv_index=kv_index,
            query_pos=computed.unsqueeze(1) + steps,  # absolute position of each new token
            slot_ids=self.slot_ids,
            valid_index=None if self.valid_id is None else pack.get(self.valid_id),
            starts=self.starts,
            replay_counts=None if self.replay_counts_id is None else pack.get(self.replay_counts_id),
        )


@dataclass
class _Row:
    """One row of a token group: a scheduled request's chunk, or a padding row (`request` None)."""

    num_computed: int
    num_new: int
    block_table: list[int]
    slot: int
    request: Request | None
    samples: bool

    def token_ids(self) -> list[int]:
        """The ids of the row's new tokens (0 for a padding row, and for a decode row whose token is
        still on the device: `PendingInputs` writes it there)."""
        if self.request is None or self.num_computed >= self.request.num_known_tokens:
            return [0] * self.num_new
        return self.request.token_ids(self.num_computed, self.num_computed + self.num_new)

    def kv_rows(self, block_size: int) -> torch.Tensor:
        """The KV pool row each new token is written to."""
        start = self.num_computed
        if self.num_new == 1:
            return long_tensor([self.block_table[start // block_size] * block_size + start % block_size])
        positions = torch.arange(start, start + self.num_new, dtype=torch.long)
        blocks = torch.tensor(self.block_table[: -(-(start + self.num_new) // block_size)], dtype=torch.long)
        return blocks[positions // block_size] * block_size + positions % block_size

    @classmethod
    def of(cls, s: ScheduledRequest) -> _Row:
        req = s.request
        # never None for a scheduled row: the scheduler gives every running request a slot
        slot = req.state_slot or 0
        return cls(req.num_computed_tokens, s.num_new_tokens, req.block_table, slot, req, s.samples)
