"""The engine loop: requests in, one scheduled model step at a time, token deltas out."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from splitserve.engine.cache_budget import default_kv_cache_bytes
from splitserve.engine.cache_pool import BlockAllocator, SlotAllocator, allocate_caches
from splitserve.engine.cache_spec import CachePlan, context_len, plan_cache
from splitserve.engine.cuda_graph_plan import plan_decode_padding
from splitserve.engine.loader import load_model
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.ops.kda_dispatch import kda_backend
from splitserve.engine.parallel.commands import (
    AbortRequest,
    AddRequest,
    AdmitTransferred,
    FinishRequest,
    FollowPublishes,
    ListenReplays,
    PromptLogits,
    ReadTransferred,
    ReserveTransfer,
    SetRetention,
    Step,
    WriteTransferred,
)
from splitserve.engine.parallel.group import SINGLE, TensorParallel
from splitserve.engine.parallel.handoff import DriverExports, FollowerExports, ShardingSink, StoreRead
from splitserve.engine.parallel.heads import rank_heads
from splitserve.engine.parallel.local_ranks import LocalProcesses
from splitserve.engine.parallel.ranks import RankLauncher, Ranks
from splitserve.engine.parallel.retained import DriverRetained, FollowerRetained
from splitserve.engine.parallel_sampling import SampleForker, SampleStart, make_samples
from splitserve.engine.prefix_cache import ImportedPrefix, PrefixCacheStats, PrefixEvent, RetainedPrefix
from splitserve.engine.prefix_cache.cache import PrefixCache, make_prefix_cache
from splitserve.engine.prefix_cache.match import find_hit
from splitserve.engine.replay_publish import (
    PendingPublish,
    ReplayLayerPiece,
    ReplayListener,
    replay_publisher,
)
from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from splitserve.engine.state_transfer import LayerState, token_rows
from splitserve.engine.step_pipeline import HANDOFF, RequestUpdate, StepPipeline
from splitserve.engine.swap_space import SwapSpace, SwapStats, make_swapper
from splitserve.engine.transfer_sink import TransferSink
from splitserve.engine.warm_up import use_kernel_caches, warm_up_engine
from splitserve.engine_config import EngineConfig
from splitserve.sampling_params import MAX_SAMPLES, SamplingParams, sample_request_id

logger = logging.getLogger(__name__)

__all__ = ["HANDOFF", "LLMEngine", "RequestUpdate"]  # the step's types live in step_pipeline.py


def async_scheduling(config: EngineConfig, device: torch.device) -> bool:
    """Whether the engine queues each step before reading the last one's tokens: as configured, else
    on a CUDA device (where the device runs while the host schedules) and not on a CPU."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    return device.type == "cuda"


class LLMEngine:
    """Owns one model replica, its caches, scheduler and sampler; not thread-safe (one driver).

    With `tensor_parallel_size` N > 1 this engine is rank 0 of N: it starts ranks 1..N-1 through
    `launcher` (local processes by default; a cluster worker's Ray actors in their own bundles,
    engine/parallel/actor_ranks.py), each an `LLMEngine` of its own over its shard, and forwards every
    call that changes state to them (`parallel/commands.py`); it alone samples. `shutdown()` (or
    the engine being dropped, or the interpreter leaving) ends them. A rank's engine is built with
    its `tp` given and forwards nothing. Every rank ends its construction with the same warm-up
    (engine/warm_up.py), so the warm-up's steps meet in the same collectives on every rank.
    State handed off in or out goes through every rank, each with its heads (parallel/handoff.py),
    and so do the prefixes it retains for the store and those it imports (parallel/retained.py,
    `ImportedPrefix.for_heads`).
    """

    def __init__(
        self, config: EngineConfig, tp: TensorParallel | None = None, launcher: RankLauncher | None = None
    ) -> None:
        load_start_s = time.monotonic()
        self.ranks: Ranks | None = None
        if tp is None and config.tensor_parallel_size > 1:
            launcher = launcher or LocalProcesses()
            config = launcher.rank_config(config, 0)
            # refused before any rank starts; each rank checks its own device again as it builds
            _check_kernels(_model_config(config), torch.device(config.device))
            self.ranks, tp = Ranks.launch(config, launcher)
        try:
            self._build(config, tp or SINGLE, load_start_s)
            if self.ranks is not None:
                self.ranks.wait_ready()
        except BaseException as exc:
            if self.ranks is not None:  # a rank's own error says more than the driver's broken collective
                failures = self.ranks.failures()
                self.ranks.close()
                if failures and not isinstance(exc, KeyboardInterrupt):
                    raise RuntimeError("a rank failed to start:\n" + "\n".join(failures)) from exc
            raise

    def _build(self, config: EngineConfig, tp: TensorParallel, load_start_s: float) -> None:
        self.config = config
        self.tp = tp
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = Path(config.model).expanduser()
        self.model_config = _model_config(config)
        mc = self.model_config
        if mc.hidden_act != "silu":
            raise ValueError(f"hidden_act {mc.hidden_act!r} is not supported (only 'silu')")
        self.device = torch.device(config.device)
        use_kernel_caches(self.device)  # before anything compiles: a restart finds the kernels there
        _check_kernels(mc, self.device)  # on every rank, before the weights load
        dtype = getattr(torch, config.dtype)  # EngineConfig.dtype is a torch dtype name
        context_len(mc, config)  # a max_model_len beyond the checkpoint's fails before the weights load
        self.model = load_model(mc, path, dtype, self.device, tp)
        self.plan, self.max_model_len = self._plan_cache()
        # decode batches padded to a CUDA graph's bucket (None: as before) use a scratch block and slot
        self.padding = plan_decode_padding(
            config, self.model, self.device, self.plan.num_blocks, self.plan.num_slots
        )
        self.caches = allocate_caches(self.plan, mc, self.device, scratch=self.padding is not None)
        # None: plain KDA decode; a tensor-parallel rank's KDA pieces name its heads, rank 0 alone gives MLA rows
        heads = rank_heads(mc.linear_num_heads, tp.rank, tp.size) if tp.size > 1 else None
        self.replay = replay_publisher(self.caches, config, self.device, heads, with_mla=tp.rank == 0)
        # a rank > 0's KDA pieces of this step's publishes, for its process to send rank 0
        self.follower_replays: list[list[ReplayLayerPiece]] = []
        self.swapper = make_swapper(config, self.caches)  # None: preemption by recompute only
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=config.block_size,
            ),
            *self._block_pool(),
            swapper=self.swapper,
        )
        self.forker = SampleForker(self.scheduler, self.caches, config.block_size)
        self.sampler = Sampler(mc.vocab_size, mc.eos_token_ids, device=self.device, base_seed=config.seed)
        self.runner = ModelRunner(
            self.model,
            self.caches,
            self.sampler,
            config.block_size,
            self.device,
            self.padding,
            self.max_model_len,
            tp,
        )
        # a tensor-parallel engine's ranks follow one step at a time: no step queued ahead there
        self.async_scheduling = async_scheduling(config, self.device) and tp.size == 1
        self._steps = StepPipeline(self, overlap=self.async_scheduling)
        self.requests: dict[str, Request] = {}
        self._sinks: dict[str, ShardingSink] = {}  # reserved requests' state, written from any thread
        num_heads = self.model_config.linear_num_heads
        self.driver_exports = DriverExports(tp, num_heads) if tp.size > 1 and tp.rank == 0 else None
        self.follower_exports = FollowerExports(tp, num_heads) if tp.rank > 0 else None
        self.heads = rank_heads(num_heads, tp.rank, tp.size)  # the KDA heads this rank holds
        self.driver_retained = DriverRetained(tp, num_heads) if tp.size > 1 and tp.rank == 0 else None
        self.follower_retained = FollowerRetained(tp, num_heads) if tp.rank > 0 else None
        self.rank_reads: Any = None  # a rank's own store reads (worker/rank_reads.py), made on the first
        self._read_on_ranks: set[str] = set()  # rank 0: reservations every rank reads itself
        self.num_forwarded_pieces = 0  # rank 0: pieces it cut for the other ranks (none where they read)
        self._arrivals = itertools.count()
        self.warm_up = warm_up_engine(self, load_start_s)  # compiles, autotunes before the first request
        logger.info(
            "engine ready: %d KV blocks x %d tokens, %d state slots, %.1f MiB of cache; %d prefix snapshots",
            self.plan.num_blocks,
            config.block_size,
            self.plan.num_slots,
            self.plan.total_bytes / 2**20,
            self.plan.num_snapshots,
        )

    def _block_pool(self) -> tuple[BlockAllocator, SlotAllocator, PrefixCache | None]:
        """The block and slot allocators, and the prefix cache when caching is on."""
        self.prefix_cache = make_prefix_cache(self.config, self.plan, self.caches)
        blocks = (
            BlockAllocator(self.plan.num_blocks) if self.prefix_cache is None else self.prefix_cache.blocks
        )
        return blocks, SlotAllocator(self.plan.num_slots, self.caches), self.prefix_cache

    def _plan_cache(self) -> tuple[CachePlan, int]:
        """The cache plan and max_model_len (the budget defaulted if not given); logs a chosen length."""
        config, mc = self.config, self.model_config
        budget, why = config.kv_cache_memory_bytes, None
        if budget is None:
            budget, why = default_kv_cache_bytes(mc, config, self.device)
            budget = self.tp.min_over_ranks(budget)  # every rank plans the same blocks and slots
        try:
            plan, max_model_len = plan_cache(mc, config, budget)
        except ValueError as exc:
            if why is None:
                raise
            raise ValueError(f"{exc} ({why})") from None
        if config.max_model_len is None:
            logger.info(
                "max_model_len not given: using %s tokens (the checkpoint's context is %s; a KV budget "
                "of %.1f MiB%s holds %s tokens for one request beside %d state slots)",
                f"{max_model_len:,}",
                f"{mc.max_position_embeddings:,}",
                budget / 2**20,
                f" ({why})" if why else "",
                f"{plan.max_tokens_per_request:,}",
                plan.num_slots,
            )
        return plan, max_model_len

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        export: Callable[[LayerState], None] | None = None,
        *,
        prefix_hashes: list[bytes] | None = None,
        imported_prefix: ImportedPrefix | None = None,
        output_token_ids: list[int] | None = None,
        prefill_only: bool = False,
    ) -> Request:
        """Validate and queue; raises ValueError naming what is wrong with the request.

        `prefix_hashes` is the prompt's hash chain (`splitserve.prefix_hash`, one name per whole
        `prefix_unit`, the gateway's salt); without it a caching engine names the prompt itself
        (salt `config.prefix_salt`, "" by default). `imported_prefix` is a prefix's state fetched
        from elsewhere (see `ImportedPrefix`). Both are ignored when prefix caching is off.

        `output_token_ids`: tokens this request already generated elsewhere (decode failover): the
        engine computes prompt + these and samples the next as output index len(output_token_ids),
        so seeded sampling continues exactly; max_tokens counts them.

        With `export`, the request is prefill-only: it ends after its first token (finish reason
        "handoff" unless that token already ended it) and `export` receives its state as it becomes
        final: each prompt chunk's MLA rows as that chunk finishes each MLA layer, the KDA states as
        the final chunk finishes each KDA layer. It runs on the engine thread: queue, do not send.
        A preempted request recomputes and exports its rows again. `prefill_only` without `export`:
        the same end after the first token, nothing exported (a tensor-parallel rank's copy).
        """
        if output_token_ids and params.num_samples > 1:
            raise ValueError(
                "a request resumed with output_token_ids is one sample: send n=1 with that sample's seed"
            )
        stored = imported_prefix  # any width's pieces: each rank takes its own heads of them
        if imported_prefix is not None and self.prefix_cache is not None:
            imported_prefix = imported_prefix.for_heads(self.heads)
        if self.ranks is not None:
            # every rank makes the same samples of it and forks them at the same step
            command = AddRequest(
                request_id,
                list(prompt_token_ids),
                params,
                prefill_only or export is not None,
                prefix_hashes,
                output_token_ids,
                export_to_driver=export is not None,
            )
            self._add_on_ranks(command, stored)
            if export is not None and self.driver_exports is not None:
                export = self.driver_exports.wrap(export)
        first = self._new_request(request_id, prompt_token_ids, params, prompt)
        samples = make_samples(
            first,
            lambda rid, p: Request(
                rid, first.prompt_token_ids, p, first.max_tokens, next(self._arrivals), prompt=prompt
            ),
        )
        request = samples[0]
        if output_token_ids:
            request.output_token_ids = self._resumed_outputs(request, output_token_ids)
            request.num_given_output_tokens = len(request.output_token_ids)
        request.export = export
        if self.prefix_cache is not None:
            self.prefix_cache.check_request(request, prefix_hashes, imported_prefix)
        for sample in samples:
            sample.prefill_only = export is not None or prefill_only
            sample.prefix_hashes = request.prefix_hashes
            self.requests[sample.request_id] = sample
        self.scheduler.add(request)
        return request

    def _add_on_ranks(self, command: AddRequest, imported: ImportedPrefix | None) -> None:
        """Forward an add to every other rank, each with its heads of an imported prefix (all cut
        before any rank hears of it: a prefix that cannot be cut is refused by every rank alike)."""
        assert self.ranks is not None
        if imported is None or self.prefix_cache is None:
            self.ranks.send(command)
            return
        num_heads = self.model_config.linear_num_heads
        shares = [imported.for_heads(rank_heads(num_heads, r, self.tp.size)) for r in range(1, self.tp.size)]
        for rank, share in enumerate(shares, start=1):
            self.ranks.send_to(rank, dataclasses.replace(command, imported_prefix=share))

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None
    ) -> Request:
        if self._engine_ids(request_id):
            raise ValueError(f"request id {request_id!r} is already in flight")
        ids = self.validate_prompt(prompt_token_ids)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return Request(request_id, ids, params, max_tokens, next(self._arrivals), prompt=prompt)

    def _resumed_outputs(self, request: Request, output_token_ids: list[int]) -> list[int]:
        """Tokens already generated for `request` elsewhere, checked against its limits."""
        ids = self._in_vocab(output_token_ids, "output token id")
        if len(ids) >= request.max_tokens:
            raise ValueError(
                f"{len(ids)} tokens were already generated; the request allows {request.max_tokens}: "
                "nothing is left to generate"
            )
        return ids

    def reserve_transfer(self, request_id: str, num_prompt_tokens: int, num_samples: int = 1) -> bool:
        """Hold a slot and KV blocks for a prompt of `num_prompt_tokens` whose state another engine
        computes, and a slot and a block for each further sample it forks into on admission
        (`admit_transferred_samples`). False when there is no room now (the caller retries
        elsewhere or later)."""
        if self._engine_ids(request_id):
            raise ValueError(f"request id {request_id!r} is already in flight")
        if not 0 < num_prompt_tokens < self.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt_tokens:,} tokens; this model takes 1 to {self.max_model_len - 1:,}"
            )
        if not 1 <= num_samples <= self.config.max_num_seqs:
            raise ValueError(
                f"{num_samples} samples need as many state slots; this worker runs at most "
                f"{self.config.max_num_seqs} requests (max_num_seqs)"
            )
        placeholder = Request(request_id, [0] * num_prompt_tokens, SamplingParams(), 1, next(self._arrivals))
        if not self.scheduler.reserve(placeholder, num_prompt_tokens + 1):
            return False
        if num_samples > 1 and not self.forker.reserve_room(placeholder, num_samples - 1):
            self.scheduler.finish(placeholder, "abort")
            return False
        assert placeholder.state_slot is not None
        self.requests[request_id] = placeholder
        rows = token_rows(placeholder.block_table, num_prompt_tokens, self.config.block_size)
        local = TransferSink(self.caches, rows, placeholder.state_slot, num_prompt_tokens, self.device)
        forward = None
        if self.ranks is not None:  # the same room on every rank; the reader's pieces cut for each
            self.ranks.send(ReserveTransfer(request_id, num_prompt_tokens, num_samples))
            forward = partial(self._forward_piece, request_id)
        self._sinks[request_id] = ShardingSink(local, self.tp, self.model_config.linear_num_heads, forward)
        return True

    def _forward_piece(self, request_id: str, rank: int, state: LayerState) -> None:
        """A piece written here, cut to `rank`'s heads, to that rank (the reader's thread)."""
        assert self.ranks is not None
        self.ranks.send_to(rank, WriteTransferred(request_id, state))
        self.num_forwarded_pieces += 1

    def transfer_sink(self, request_id: str) -> ShardingSink:
        """Where the state of a reservation is written, from any thread (see `TransferSink`)."""
        sink = self._sinks.get(request_id)
        if sink is None:
            raise KeyError(f"no reservation for request {request_id!r}")
        return sink

    def read_on_ranks(self, request_id: str, source: StoreRead) -> None:
        """A tensor-parallel engine's other ranks read the reservation's state from `source`
        themselves, each its heads; this rank's sink then keeps its own heads and forwards none.
        Call before the first piece is written here (nothing to do with one rank)."""
        if self.ranks is None:
            return
        self.transfer_sink(request_id).own_heads_only()
        self.ranks.send(ReadTransferred(request_id, source))
        self._read_on_ranks.add(request_id)

    def write_transferred_state(self, request_id: str, state: LayerState) -> None:
        """Scatter one arriving piece into the room `reserve_transfer` held (any thread)."""
        self.transfer_sink(request_id).write(state)

    def admit_transferred(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_token_id: int,
        first_logprobs: dict[int, float] | None = None,
        output_token_ids: list[int] | None = None,
        recomputed_token_ids: list[int] | None = None,
    ) -> Request:
        """Every piece has arrived: the request joins the batch after its first token (the only
        work left for the engine thread; the state is already in place).

        `output_token_ids` (decode failover): tokens generated before `first_token_id`; the
        reserved state covers prompt + these, and `first_token_id` is output token len(these).
        `recomputed_token_ids` (a resume from stored state): tokens already sent after
        `first_token_id`, which the engine computes (not samples) before it samples again."""
        if self.ranks is not None:  # every piece was forwarded before, or each rank reads its own
            command = AdmitTransferred(
                request_id,
                list(prompt_token_ids),
                params,
                first_token_id,
                output_token_ids,
                recomputed_token_ids=recomputed_token_ids,
            )
            self._admit_on_ranks(command)
        request = self._admit_transferred(
            request_id, prompt_token_ids, params, first_token_id, first_logprobs, output_token_ids
        )
        request.output_token_ids.extend(recomputed_token_ids or [])
        return request

    def _admit_on_ranks(self, command: AdmitTransferred) -> None:
        """Admit on every other rank; where they read the state themselves, wait until each has
        (the caller releases the stored key after this)."""
        assert self.ranks is not None
        ranks_read = command.request_id in self._read_on_ranks
        self._read_on_ranks.discard(command.request_id)
        self.ranks.send(dataclasses.replace(command, ranks_read=ranks_read))
        if ranks_read:
            for rank in range(1, self.tp.size):
                self.ranks.receive(rank)

    def _admit_transferred(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_token_id: int,
        first_logprobs: dict[int, float] | None = None,
        output_token_ids: list[int] | None = None,
    ) -> Request:
        reserved = self.scheduler.reserved.get(request_id)
        sink = self._sinks.get(request_id)
        if reserved is None or sink is None:
            raise KeyError(f"no reservation for request {request_id!r}")
        if not sink.complete:
            raise ValueError(f"state of {request_id} is incomplete: {sink.missing()}")
        request = self._new_request("", prompt_token_ids, params, None)
        earlier = self._resumed_outputs(request, output_token_ids) if output_token_ids else []
        if request.num_prompt_tokens + len(earlier) != reserved.num_prompt_tokens:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens (+{len(earlier)} already generated); "
                f"{reserved.num_prompt_tokens} were reserved"
            )
        self._sinks.pop(request_id).close()  # from here steps read its rows: no writer may touch them
        reserved.prompt_token_ids, reserved.params, reserved.max_tokens = (
            request.prompt_token_ids,
            params,
            request.max_tokens,
        )
        reserved.num_computed_tokens = request.num_prompt_tokens + len(earlier)
        reserved.arrival_s = time.monotonic()  # it queues from here, not from the reservation
        reserved.output_token_ids = [*earlier, int(first_token_id)]
        if first_logprobs is not None:
            reserved.output_logprobs.append(first_logprobs)
        self.scheduler.admit_reserved(reserved)
        return reserved

    def admit_transferred_samples(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, starts: list[SampleStart]
    ) -> list[Request]:
        """`admit_transferred` for a request of several samples: `starts[i]` is sample i's first
        token, drawn where the prompt was computed. The samples not finished by it join the batch
        (ids `sample_request_id(request_id, i)`): the first takes the reserved state, the others
        fork it into the room `reserve_transfer` held for them; room left over is given back."""
        if len(starts) != params.num_samples:
            raise ValueError(f"{len(starts)} first tokens for {params.num_samples} samples")
        live = [i for i, start in enumerate(starts) if not start.finished]
        reserved = self.scheduler.reserved.get(request_id)
        if not live or reserved is None or len(reserved.fork_slots) < len(live) - 1:
            room = "no reservation" if reserved is None else f"room for {1 + len(reserved.fork_slots)}"
            raise ValueError(f"{len(live)} samples of {request_id} to decode; {room} was reserved")
        if self.ranks is not None:
            self._admit_on_ranks(
                AdmitTransferred(request_id, list(prompt_token_ids), params, 0, starts=list(starts))
            )
        head = starts[live[0]]
        parent = self._admit_transferred(
            request_id, prompt_token_ids, params.for_sample(live[0]), head.token_id, head.logprobs
        )
        self.requests.pop(request_id)
        parent.request_id, parent.sample_index = sample_request_id(request_id, live[0]), live[0]
        self.requests[parent.request_id] = parent
        admitted = [parent]
        for i in live[1:]:
            sample = Request(
                sample_request_id(request_id, i),
                parent.prompt_token_ids,
                params.for_sample(i),
                parent.max_tokens,
                next(self._arrivals),
                output_token_ids=[starts[i].token_id],
                sample_index=i,
            )
            logprobs = starts[i].logprobs
            if logprobs is not None:
                sample.output_logprobs.append(logprobs)
            self.forker.fork(parent, sample)  # into the reserved room: cannot fail
            self.requests[sample.request_id] = sample
            admitted.append(sample)
        self.scheduler.release_fork_room(parent)
        return admitted

    def _in_vocab(self, token_ids: list[int], what: str) -> list[int]:
        ids = [int(t) for t in token_ids]
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def validate_prompt(self, prompt_token_ids: list[int]) -> list[int]:
        ids = self._in_vocab(prompt_token_ids, "token id")
        if not ids:
            raise ValueError("prompt is empty: send at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids):,} tokens; this model takes at most {self.max_model_len - 1:,} "
                f"(max_model_len {self.max_model_len:,} includes at least one generated token)"
            )
        return ids

    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """Logits [L, vocab] (fp32) at every prompt position, computed chunk by chunk like a prefill
        (on rank 0; another rank of a tensor-parallel engine computes its part and returns nothing)."""
        if self.ranks is not None:
            self.ranks.send(PromptLogits(list(prompt_token_ids)))
        request = Request("__score__", self.validate_prompt(prompt_token_ids), SamplingParams(), 1, -1)
        scheduler = self.scheduler
        request.state_slot = scheduler.slots.allocate()
        if request.state_slot is None:
            raise RuntimeError("no free state slot to score with; wait for running requests to finish")
        try:
            pieces: list[torch.Tensor] = []
            while request.num_computed_tokens < request.num_tokens:
                num_new = min(
                    request.num_tokens - request.num_computed_tokens, self.config.max_num_batched_tokens
                )
                if not scheduler.reserve_blocks(request, num_new):
                    raise RuntimeError("not enough free KV blocks to score this prompt now")
                logits = self.runner.chunk_logits(ScheduledRequest(request, num_new))
                if logits is not None:  # None on a rank past the first: rank 0 gathers the vocabulary
                    pieces.append(logits)
                request.num_computed_tokens += num_new
            return torch.cat(pieces) if pieces else torch.empty(0)
        finally:
            scheduler.release(request)

    def abort_request(self, request_id: str) -> None:
        """Abort a request (every sample of one with several), or one sample by its own id."""
        if self.ranks is not None:
            sink = self._sinks.get(request_id)
            if sink is not None:
                sink.close()  # no piece is forwarded after the ranks drop the reservation
            self.ranks.send(AbortRequest(request_id))  # each rank aborts the same samples
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        self._read_on_ranks.discard(request_id)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.close()  # waits out a piece being written, so its room is freed only after
        for engine_id in self._engine_ids(request_id):
            request = self.requests.pop(engine_id, None)
            if request is not None and not request.finished:
                self.scheduler.finish(request, "abort")
            for waiting in request.samples_to_fork if request is not None else []:
                self._abort(waiting.request_id)  # they wait for this one's prompt

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` (a request, or one sample of one) is in flight here."""
        return bool(self._engine_ids(request_id))

    def _engine_ids(self, request_id: str) -> list[str]:
        """The ids in `requests` a request runs under: its own, or its samples' (parallel_sampling.py)."""
        if request_id in self.requests:
            return [request_id]
        ids = (sample_request_id(request_id, i) for i in range(MAX_SAMPLES))
        return [engine_id for engine_id in ids if engine_id in self.requests]

    def finish_request(self, request_id: str, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request the caller decided is done (a stop string it found in the text): its tokens
        so far are its output; unknown or finished ids are ignored."""
        if self.ranks is not None:
            self.ranks.send(FinishRequest(request_id, reason, stop_reason))
        request = self.requests.pop(request_id, None)
        if request is not None and not request.finished:
            self.scheduler.finish(request, reason, stop_reason)  # retains what it computed
        self._relay_retained()

    def shutdown(self) -> None:
        """End the other ranks' processes (a tensor-parallel engine); nothing to do with one rank."""
        if self.ranks is not None:
            self.ranks.close()

    def set_replay_listener(self, fn: ReplayListener | None) -> None:
        """`fn` hears a `ReplayPublish` each time a decoding request's slot folds a full window
        (every `replay_window` tokens; engine/replay_publish.py), on the engine thread: queue it,
        never block. Without `replay_window` nothing is ever published. Set it between steps (a
        tensor-parallel engine's ranks follow: they must collect the same publishes as this rank)."""
        if self.replay is None:
            raise ValueError("this engine decodes without ReplaySSM rings: set replay_window to publish")
        self.replay.listener = fn
        if self.ranks is not None:  # the ranks collect the same publishes: their KDA shares come here
            self.ranks.send(ListenReplays(fn is not None))

    def set_retention_listener(self, fn: Callable[[RetainedPrefix], None] | None) -> None:
        """Call `fn` on the engine thread with a copy of each retained prefix's state (queue it,
        never block); None stops. Without prefix caching nothing is ever retained. A
        tensor-parallel engine hands `fn` each prefix after the call that retained it, with every
        rank's KDA heads as pieces naming them (parallel/retained.py)."""
        if self.prefix_cache is None:
            return
        if self.ranks is None or self.driver_retained is None:
            self.prefix_cache.listener = fn
            return
        self.ranks.send(SetRetention(fn is not None))
        self.driver_retained.listener = fn
        self.prefix_cache.listener = None if fn is None else self.driver_retained.hold

    def _relay_retained(self) -> None:
        """Rank 0, after a call: the prefixes it retained, with every rank's shares, to the listener."""
        if self.driver_retained is not None and self.driver_retained.held:
            assert self.ranks is not None
            self.driver_retained.complete(self.ranks.receive)

    def num_cached_prompt_tokens(
        self, prompt_token_ids: Sequence[int], prefix_hashes: list[bytes] | None = None
    ) -> int:
        """Prompt tokens this engine's prefix cache would serve the prompt now (engine thread;
        reads the cache's index, moves nothing; 0 with caching off). Admission finds the same hit
        (`find_hit`) unless it is evicted in between. `prefix_hashes` as for `add_request`."""
        cache = self.prefix_cache
        if cache is None or len(prompt_token_ids) < 2:
            return 0
        probe = Request("__prefix_probe__", list(prompt_token_ids), SamplingParams(max_tokens=1), 1, -1)
        probe.prefix_hashes = list(prefix_hashes) if prefix_hashes else None
        limit = len(prompt_token_ids) - 1  # as admission: the last token is always computed
        match = find_hit(cache, probe, cache.naming.chain(probe, limit), limit)
        return match.hit.num_tokens if match.hit is not None else 0

    def take_prefix_events(self) -> list[PrefixEvent]:
        """Prefix events since the last call (`stored` and `removed`, for a router's index)."""
        return self.prefix_cache.take_events() if self.prefix_cache is not None else []

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counters since start (all zero without caching)."""
        return self.prefix_cache.current_stats() if self.prefix_cache is not None else PrefixCacheStats()

    def set_swap_space(self, space: SwapSpace) -> None:
        """Swap preempted requests' states into `space` from now on (a cluster's decode worker
        passes its node's store); only in swap mode, and only while no request is swapped out."""
        if self.swapper is None:
            raise ValueError("this engine preempts by recompute: set preemption_mode='swap' to swap")
        if self.scheduler.swapped:
            num = len(self.scheduler.swapped)
            raise RuntimeError(f"{num} requests are swapped out: change the swap space when none is")
        self.swapper.space = space

    def swap_stats(self) -> SwapStats:
        """The swapper's counters since start (all zero when preempting by recompute)."""
        return self.swapper.stats if self.swapper is not None else SwapStats()

    @property
    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or a step whose tokens are not read yet (async scheduling)."""
        return self.scheduler.has_unfinished or self._steps.in_flight

    def step(self) -> list[RequestUpdate]:
        """Run one scheduled batch; return the requests that got tokens (finished ones included).

        With async scheduling this queues the next step and returns the tokens of the one before
        it (engine/step_pipeline.py): a request's tokens come one call later, the same tokens. The
        ranks of a tensor-parallel engine step with it (always synchronously).
        """
        if self.ranks is not None:
            if self.replay is not None and (standing := self.replay.take_dropped()):
                self.ranks.send(FollowPublishes(standing))  # publishes the listener refused last step
            self.ranks.send(Step())
        updates = self._steps.step()
        self._relay_retained()  # a tensor-parallel engine: what the step retained, every rank's heads
        return updates

    def relay_exports(self) -> None:
        """Rank 0, after a step's forward: the KDA shares every rank exported in it, relayed in order."""
        if self.driver_exports is not None and (calls := self.driver_exports.take_calls()):
            assert self.ranks is not None  # rank 0 exported KDA shares: so did every rank, in order
            for rank in range(1, self.tp.size):
                self.driver_exports.relay(calls, self.ranks.receive(rank), rank)

    def relay_replays(self, collected: list[PendingPublish]) -> None:
        """Tensor parallel, once a step's publishes are collected (every rank collects the same):
        rank 0 adds each other rank's KDA pieces to them, in order; a rank > 0 keeps its own for
        its process to send rank 0 after the step."""
        if not collected:
            return
        if self.tp.rank > 0:
            self.follower_replays = [pending.publish.kda for pending in collected]
        elif self.ranks is not None:
            for rank in range(1, self.tp.size):
                shares = self.ranks.receive(rank)
                if len(shares) != len(collected):
                    raise RuntimeError(
                        f"rank {rank} collected {len(shares)} publishes this step; rank 0 {len(collected)}"
                    )
                for pending, kda in zip(collected, shares, strict=True):
                    pending.publish.kda.extend(kda)

    def take_follower_replays(self) -> list[list[ReplayLayerPiece]]:
        """A rank > 0: its KDA pieces of the publishes of the step just run (see `relay_replays`)."""
        shares, self.follower_replays = self.follower_replays, []
        return shares


def _model_config(config: EngineConfig) -> KimiLinearModelConfig:
    return KimiLinearModelConfig.from_pretrained(Path(config.model).expanduser())


def _check_kernels(mc: KimiLinearModelConfig, device: torch.device) -> None:
    """Refuse a device this install has no KDA kernels for (CUDA without fla; kda_dispatch says what to do)."""
    if mc.kda_layer_ids:
        kda_backend(device)
