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

from splitserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class Command:
    """One engine call to repeat on every other rank."""

    # a failure of this call on a rank is a fault of that rank, not the caller's bad input
    must_succeed = False

    def apply(self, engine: LLMEngine) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class AddRequest(Command):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    prefix_hashes: list[bytes] | None = None
    output_token_ids: list[int] | None = None

    def apply(self, engine: LLMEngine) -> None:
        engine.add_request(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            prefix_hashes=self.prefix_hashes,
            output_token_ids=self.output_token_ids,
            prefill_only=self.prefill_only,
        )


@dataclass(frozen=True)
class AbortRequest(Command):
    request_id: str

    def apply(self, engine: LLMEngine) -> None:
        engine.abort_request(self.request_id)


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
class PromptLogits(Command):
    prompt_token_ids: list[int] = field(default_factory=list)

    def apply(self, engine: LLMEngine) -> None:
        engine.prompt_logits(self.prompt_token_ids)


@dataclass(frozen=True)
class Shutdown(Command):
    """The rank ends its loop and its process."""

    def apply(self, engine: LLMEngine) -> None:
        return None
