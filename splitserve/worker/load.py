"""A decode-capable engine's room, as the router reads it (Decode.Stats)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.v1 import decode_pb2

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine


def decode_stats(engine: LLMEngine) -> decode_pb2.DecodeStats:
    """Room as the router reads it: free KV blocks and state slots, running and reserved seqs."""
    sched = engine.scheduler
    return decode_pb2.DecodeStats(
        num_running_seqs=len(sched.running),
        num_reserved=len(sched.reserved),
        max_num_seqs=engine.config.max_num_seqs,
        num_free_kv_blocks=sched.blocks.num_free_blocks,
        num_total_kv_blocks=engine.plan.num_blocks,
        num_free_state_slots=sched.slots.num_free_slots,
        num_total_state_slots=engine.plan.num_slots,
    )
