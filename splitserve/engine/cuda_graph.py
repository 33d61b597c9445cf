"""CUDA graphs of the decode forward, one per batch-size bucket (cuda_graph_plan.py says which and why).

Each graph runs the model over static input buffers sized for the largest bucket: token ids,
positions, state slots, block-table rows and, with ReplaySSM, each row's record count. Everything
the forward derives from them (each new token's KV row, each row's context KV rows, where a ReplaySSM
record goes and whether its ring folds) is computed inside the graph, so a replay needs only those
copied in. The context is as wide as `max_model_len` (rows past a row's position are
never read: attention stops at its `query_pos`). Sampling stays outside: a replay returns the final
hidden state of every row, and the runner computes logits for the first `b` only.

Buckets are captured largest first into one shared memory pool, each after a warm-up forward at
its own shapes (Triton compiles per specialisation, fla autotunes), on the scratch row and slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from splitserve.engine.cuda_graph_plan import DecodePadding
from splitserve.engine.forward_batch import ForwardBatch, TokenGroup
from splitserve.engine.host_pack import HostPack, block_tables, long_tensor
from splitserve.engine.model.kimi_linear import KimiLinearForCausalLM, LayerCaches
from splitserve.engine.pending_inputs import PendingInputs
from splitserve.engine.request import Request

logger = logging.getLogger(__name__)
_WARMUP_FORWARDS = 2


class DecodeGraphs:
    """Owns the captured graphs, their static inputs and outputs; `run` replays the bucket a batch needs.

    Promises: a replay reads and writes exactly what the eager forward of the same rows would, plus
    the scratch KV row and state slot for padding rows; the caches and weights are the tensors
    captured (never reallocated), so a replay sees every change made between steps.
    """

    def __init__(
        self,
        model: KimiLinearForCausalLM,
        caches: LayerCaches,
        padding: DecodePadding,
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model, self.caches, self.padding = model, caches, padding
        self.block_size = block_size
        self.device = device
        num_rows = max(padding.batch_sizes)
        self.max_blocks = -(-max_model_len // block_size)
        long = torch.long
        self.input_ids = torch.zeros(num_rows, dtype=long, device=device)
        self.positions = torch.zeros(num_rows, dtype=long, device=device)
        self.slots = torch.full((num_rows,), padding.scratch_slot, dtype=long, device=device)
        self.block_tables = torch.full(
            (num_rows, self.max_blocks), padding.scratch_block, dtype=long, device=device
        )
        context = torch.arange(self.max_blocks * block_size, dtype=long, device=device)
        self._context_blocks, self._context_offsets = context // block_size, context % block_size
        self._rows = torch.arange(num_rows, dtype=long, device=device)
        self._valid = torch.ones(num_rows, 1, dtype=torch.bool, device=device)
        # ReplaySSM: records each row's ring holds (padding rows: 0); the host slot ids the torch
        # reference's folds read (eager forwards only: graphs need the Triton kernel, cuda_graph_plan)
        self.replay_counts = torch.zeros(num_rows, dtype=long, device=device)
        self._slot_ids = [padding.scratch_slot] * num_rows
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0  # what `capture` took, warm-up forwards included (the load log reports it)

    @torch.inference_mode()
    def capture(self) -> None:
        start_s = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.padding.batch_sizes, reverse=True):
            for _ in range(_WARMUP_FORWARDS):
                self.forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s = time.monotonic() - start_s
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
            len(self.graphs),
            self.padding.batch_sizes,
            self.capture_s,
        )

    def forward(self, size: int) -> torch.Tensor:
        """The decode forward of the first `size` rows of the static buffers (what a graph records)."""
        bs = self.block_size
        positions, tables = self.positions[:size], self.block_tables[:size]
        kv_index = tables[:, self._context_blocks] * bs + self._context_offsets  # [size, max_model_len]
        slot_mapping = tables.gather(1, (positions // bs).unsqueeze(1)).squeeze(1) * bs + positions % bs
        rows = self._rows[:size]
        group = TokenGroup(
            token_index=rows.unsqueeze(1),
            valid=self._valid[:size],
            lengths=[1] * size,
            state_slots=self.slots[:size],
            kv_index=kv_index,
            query_pos=positions.unsqueeze(1),
            slot_ids=self._slot_ids[:size],
            replay_counts=self.replay_counts[:size] if self.caches.replay is not None else None,
        )
        batch = ForwardBatch(
            input_ids=self.input_ids[:size],
            slot_mapping=slot_mapping,
            logits_indices=rows,
            single=group,
            multi=None,
        )
        return self.model(batch, self.caches)

    def run(
        self, requests: Sequence[Request], size: int, pending: PendingInputs | None = None
    ) -> torch.Tensor:
        """Replay the graph of bucket `size` for one decode token of each request (at most `size`);
        returns their final hidden states [len(requests), hidden], in order. `pending`: the rows
        whose input id is the last step's sample, on the device."""
        self.load(requests, size, pending)
        self.graphs[size].replay()
        if self.caches.replay is not None:  # what each layer's eager `step` does on the host
            self.caches.replay.advance([r.running_slot for r in requests])
        return self.outputs[size][: len(requests)]

    def load(self, requests: Sequence[Request], size: int, pending: PendingInputs | None = None) -> None:
        """Copy the inputs of one decode token per request into the static buffers, then padding
        rows (token 0 at position 0 on the scratch block and slot) up to `size` rows. A row in
        `pending` takes its id from the last step's samples, on the device."""
        num_pad = size - len(requests)
        width = max([1, *(-(-(r.num_computed_tokens + 1) // self.block_size) for r in requests)])
        tables = [r.block_table for r in requests] + [[]] * num_pad
        pack = HostPack()  # one host-to-device copy for every buffer
        table_id = pack.add(block_tables(tables, width, fill=self.padding.scratch_block))
        known = [
            r.token_at(r.num_computed_tokens) if r.num_computed_tokens < r.num_known_tokens else 0
            for r in requests
        ]
        ids = pack.add(long_tensor(known + [0] * num_pad))
        positions = pack.add(long_tensor([r.num_computed_tokens for r in requests] + [0] * num_pad))
        slots = pack.add(
            long_tensor([r.running_slot for r in requests] + [self.padding.scratch_slot] * num_pad)
        )
        replay = self.caches.replay
        counts = None
        if replay is not None:
            counts = pack.add(
                long_tensor(replay.counts_of([r.running_slot for r in requests]) + [0] * num_pad)
            )
            self._slot_ids[:size] = [r.running_slot for r in requests] + [self.padding.scratch_slot] * num_pad
        pending_ids = None if pending is None else pending.queue(pack)
        pack.to(self.device)
        if counts is not None:
            self.replay_counts[:size].copy_(pack.get(counts))
        # columns past `width` keep an earlier step's block ids: valid rows, never read (query_pos)
        self.block_tables[:size, :width].copy_(pack.get(table_id).view(size, width))
        self.input_ids[:size].copy_(pack.get(ids))
        if pending is not None and pending_ids is not None:
            pending.fill(pack, pending_ids, self.input_ids)
        self.positions[:size].copy_(pack.get(positions))
        self.slots[:size].copy_(pack.get(slots))
