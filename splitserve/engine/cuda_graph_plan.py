"""Whether decode steps run as CUDA graphs, over which batch-size buckets, and where padding rows go.

A CUDA graph replays fixed shapes, so a decode step of `b` single-token rows runs the graph of the
smallest bucket >= b, with `bucket - b` padding rows. A padding row feeds token 0 at position 0,
writes its latent to the scratch KV row and reads and writes the scratch state slot: one KV block
and one KDA slot allocated past the cache plan's (`allocate_caches(..., scratch=True)`), so no
allocator ever hands them to a request and padding never touches a request's state. Padding rows
sample nothing: the runner takes the logits of the first `b` rows.

Graphs run only where every op of the decode forward is graph-safe (no host sync, no shape that
depends on data): on CUDA, with the Triton paged MLA kernel and, for a model with routed experts,
the fused MoE kernel (the torch references read counts back to the host) and, with ReplaySSM, its
Triton kernel (which reads each row's record count from the step's inputs and folds on the device;
the torch reference folds where the host says). Otherwise `graph_refusal` names the reason, which the
engine logs, and every step runs eagerly as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from splitserve.engine_config import EngineConfig

logger = logging.getLogger(__name__)

# vLLM's default capture sizes: 1, 2, 4, then every multiple of 8
_SMALL_SIZES = (1, 2, 4)
_SIZE_STEP = 8


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to `max_num_seqs`, which is always a bucket itself."""
    sizes = [b for b in _SMALL_SIZES if b < max_num_seqs]
    sizes += range(_SIZE_STEP, max_num_seqs, _SIZE_STEP)
    return [*sizes, max_num_seqs]


def batch_sizes(config: EngineConfig) -> list[int]:
    """The buckets `config` asks for (its own list, else the default), none above max_num_seqs."""
    sizes = list(config.cuda_graph_batch_sizes) or default_batch_sizes(config.max_num_seqs)
    return [b for b in sizes if b <= config.max_num_seqs]


def bucket_for(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest of `sizes` (ascending) holding `num_rows` rows; None when none does."""
    for size in sizes:
        if size >= num_rows:
            return size
    return None


def graph_refusal(config: EngineConfig, model: torch.nn.Module, device: torch.device) -> str | None:
    """Why decode steps cannot run as CUDA graphs on this engine, or None when they can."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if config.enforce_eager:
        return "enforce_eager is set"
    from splitserve.engine.ops.fused_moe import triton_available
    from splitserve.engine.ops.paged_mla import mla_backend
    from splitserve.engine.ops.replay_ssm import replay_backend

    if config.replay_window and replay_backend(device) != "triton":
        return (
            "ReplaySSM (replay_window > 0) runs its torch reference, whose folds the host decides; "
            "install triton and leave SPLITSERVE_REPLAY_BACKEND unset"
        )

    if mla_backend(device) != "triton":
        return (
            "paged MLA attention runs its torch reference (a context-wide gather sized by the longest "
            "row); install triton and leave SPLITSERVE_MLA_BACKEND unset"
        )
    has_experts = any(name.endswith("experts.w13") for name, _ in model.named_parameters())
    if has_experts and not triton_available():
        return "routed experts run their torch reference, which reads expert counts back to the host"
    return None


@dataclass(frozen=True)
class DecodePadding:
    """Where padding rows go and which buckets exist; `use_graphs` says whether buckets are replayed
    as CUDA graphs or the padded batch runs eagerly (the CPU tests of padding)."""

    batch_sizes: list[int]
    scratch_block: int  # KV block id past the plan's: padding rows write its first row
    scratch_slot: int  # KDA state slot past the plan's
    use_graphs: bool

    def bucket(self, num_rows: int) -> int | None:
        return bucket_for(num_rows, self.batch_sizes)


def plan_decode_padding(
    config: EngineConfig, model: torch.nn.Module, device: torch.device, num_blocks: int, num_slots: int
) -> DecodePadding | None:
    """The padding this engine uses (None: none, every step as before); logs why graphs are off.

    `num_blocks` and `num_slots` are the cache plan's: the scratch block and slot are the next ids.
    """
    refusal = graph_refusal(config, model, device)
    sizes = batch_sizes(config)
    if refusal is None and not sizes:
        refusal = f"no cuda_graph_batch_sizes at or below max_num_seqs {config.max_num_seqs}"
    if refusal is not None:
        # a CPU engine has no graphs by design; on CUDA a refusal costs decode speed: say why
        quiet = device.type != "cuda" or config.enforce_eager
        logger.log(
            logging.DEBUG if quiet else logging.WARNING, "decode runs without CUDA graphs: %s", refusal
        )
    if not sizes or (refusal is not None and not config.pad_decode_batches):
        return None
    return DecodePadding(sizes, num_blocks, num_slots, use_graphs=refusal is None)
