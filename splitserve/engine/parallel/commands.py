"""What the driver (rank 0) tells the other ranks of its engine, one message per engine call.

Every rank runs a whole `LLMEngine` of its own (scheduler, prefix cache, block and slot
allocators) over its own shard of the model and caches, as SGLang's tensor-parallel schedulers
do: the driver forwards each call that changes engine state, in order, and each rank makes the
same call on its own engine. The engines are deterministic, so every rank schedules the same
batches, allocates the same blocks and slots, and copies the same snapshots; only the sampled
tokens must be shared, and the step broadcasts them. No cache operation needs a message of its own.

A call that fails fails alike on every rank (the same validation of the same input), so a rank
drops a failed command's error: the driver raised it to its caller already. A failed `Step` is
different (a real fault: the rank's process ends and the driver's next collective fails).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.engine.parallel.handoff import StoreRead
from splitserve.engine.parallel_sampling import SampleStart
from splitserve.engine.prefix_cache.imported import ImportedPrefix
from splitserve.engine.state_transfer import LayerState
from splitserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class Command:
    """One engine call to repeat on every other rank."""

    # a failure of this call on a rank is a fault of that rank, not the caller's bad input
    must_succeed = False

    def answers(self) -> bool:
        """Whether the rank tells rank 0 it applied the call (rank 0 waits for it)."""
        return False

    def apply(self, engine: LLMEngine) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class AddRequest(Command):
    """`export_to_driver`: rank 0 exports the request's state; this rank's KDA shares go to it.
    `imported_prefix`: a stored prefix, this rank's heads of it (rank 0 cut it: `for_heads`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    prefix_hashes: list[bytes] | None = None
    output_token_ids: list[int] | None = None
    export_to_driver: bool = False
    imported_prefix: ImportedPrefix | None = None

    def apply(self, engine: LLMEngine) -> None:
        exports = engine.follower_exports
        export = exports.export if self.export_to_driver and exports else None
        engine.add_request(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            export=export,
            prefix_hashes=self.prefix_hashes,
            output_token_ids=self.output_token_ids,
            prefill_only=self.prefill_only,
            imported_prefix=self.imported_prefix,
        )


@dataclass(frozen=True)
class SetRetention(Command):
    """Rank 0's engine has a retention listener (`on`) or none: this rank keeps its KDA shares of
    what it retains for rank 0 from now on, or stops (parallel/retained.py)."""

    on: bool

    def apply(self, engine: LLMEngine) -> None:
        if engine.prefix_cache is not None and engine.follower_retained is not None:
            engine.prefix_cache.listener = engine.follower_retained.keep if self.on else None
            engine.prefix_cache.listener_wants_mla = False  # rank 0's latent is the same


@dataclass(frozen=True)
class ReserveTransfer(Command):
    """Rank 0 reserved room for handed-off state: so does every rank (the same blocks and slot)."""

    must_succeed = True
    request_id: str
    num_prompt_tokens: int
    num_samples: int = 1

    def apply(self, engine: LLMEngine) -> None:
        if not engine.reserve_transfer(self.request_id, self.num_prompt_tokens, self.num_samples):
            raise RuntimeError(f"rank {engine.tp.rank} found no room for {self.request_id} where rank 0 did")


@dataclass(frozen=True)
class WriteTransferred(Command):
    """This rank's heads of one arriving piece (every MLA piece whole), cut by rank 0's reader."""

    request_id: str
    state: LayerState

    def apply(self, engine: LLMEngine) -> None:
        engine.write_transferred_state(self.request_id, self.state)


@dataclass(frozen=True)
class ReadTransferred(Command):
    """Read a reservation's state from the store, this rank's heads of it (worker/rank_reads.py)."""

    request_id: str
    source: StoreRead

    def apply(self, engine: LLMEngine) -> None:
        if engine.rank_reads is None:
            from splitserve.worker.rank_reads import RankReads  # gRPC: only where a store is read

            engine.rank_reads = RankReads()
        engine.rank_reads.start(self.request_id, engine.transfer_sink(self.request_id), self.source)


@dataclass(frozen=True)
class AdmitTransferred(Command):
    """Admission after every piece arrived (`ranks_read`: once this rank's own read is whole; it
    then answers rank 0, which holds the key until every rank has read it)."""

    must_succeed = True
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token_id: int
    output_token_ids: list[int] | None = None
    starts: list[SampleStart] | None = None  # several samples: `admit_transferred_samples`
    ranks_read: bool = False
    recomputed_token_ids: list[int] | None = None  # a stored resume's tokens sent after the first

    def answers(self) -> bool:
        return self.ranks_read

    def apply(self, engine: LLMEngine) -> None:
        if engine.rank_reads is not None:
            engine.rank_reads.wait(self.request_id)
        if self.starts is not None:
            engine.admit_transferred_samples(self.request_id, self.prompt_token_ids, self.params, self.starts)
            return
        engine.admit_transferred(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            self.first_token_id,
            output_token_ids=self.output_token_ids,
            recomputed_token_ids=self.recomputed_token_ids,
        )


@dataclass(frozen=True)
class AbortRequest(Command):
    request_id: str

    def apply(self, engine: LLMEngine) -> None:
        engine.abort_request(self.request_id)
        if engine.rank_reads is not None:
            engine.rank_reads.cancel(self.request_id)


@dataclass(frozen=True)
class FinishRequest(Command):
    request_id: str
    reason: str
    stop_reason: int | str | None = None

    def apply(self, engine: LLMEngine) -> None:
        engine.finish_request(self.request_id, self.reason, self.stop_reason)


@dataclass(frozen=True)
class Step(Command):
    must_succeed = True

    def apply(self, engine: LLMEngine) -> None:
        engine.step()


@dataclass(frozen=True)
class ListenReplays(Command):
    """Rank 0's replay listener was set (`on`) or cleared: each rank collects the same publishes
    (its listener keeps every one), its KDA pieces of them sent to rank 0 after each step."""

    must_succeed = True
    on: bool

    def apply(self, engine: LLMEngine) -> None:
        assert engine.replay is not None  # the ranks share rank 0's config
        engine.replay.listener = _keep if self.on else None


def _keep(publish: object) -> bool:
    return True


@dataclass(frozen=True)
class FollowPublishes(Command):
    """Rank 0's listener refused these requests' publishes (its queue was full): each rank takes
    where they stand on rank 0, so their next publishes start at the same token there too."""

    must_succeed = True
    standing: dict[str, tuple[int, int, int] | None]

    def apply(self, engine: LLMEngine) -> None:
        assert engine.replay is not None
        engine.replay.follow(self.standing)


@dataclass(frozen=True)
class PromptLogits(Command):
    prompt_token_ids: list[int] = field(default_factory=list)

    def apply(self, engine: LLMEngine) -> None:
        engine.prompt_logits(self.prompt_token_ids)


@dataclass(frozen=True)
class Shutdown(Command):
    """The rank ends its loop and its process."""

    def apply(self, engine: LLMEngine) -> None:
        return None
