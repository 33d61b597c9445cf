"""A decode-capable engine's room, as the router reads it (Decode.Stats)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.v1 import decode_pb2

if TYPE_CHECKING:
    from splitserve.engine.engine_snapshot import EngineSnapshot


def decode_stats(snapshot: EngineSnapshot) -> decode_pb2.DecodeStats:
    """Room as the router reads it: free KV blocks and state slots, running and reserved seqs,
    from the engine loop's latest snapshot (`EngineLoop.snapshot()`: no wait for a step)."""
    return decode_pb2.DecodeStats(
        num_running_seqs=snapshot.num_running,
        num_reserved=snapshot.num_reserved,
        max_num_seqs=snapshot.max_num_seqs,
        num_free_kv_blocks=snapshot.num_free_kv_blocks,
        num_total_kv_blocks=snapshot.num_total_kv_blocks,
        num_free_state_slots=snapshot.num_free_state_slots,
        num_total_state_slots=snapshot.num_total_state_slots,
    )
