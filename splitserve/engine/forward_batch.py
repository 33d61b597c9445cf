"""What one model forward needs to know about the rows it runs, as tensors.

The flat token batch is laid out single-token rows first (decodes, and one-token prompt
chunks), then multi-token rows (prefill chunks). The runner builds this; the layers only read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class TokenGroup:
    """Rows of one shape class, padded to a rectangle.

    `token_index[b, i]` is the flat position of row b's i-th new token (0 where padded);
    `valid[b, i]` marks real tokens; `kv_index[b, j]` is the KV pool row of row b's j-th context token (0 where padded);
    `query_pos[b, i]` is the absolute position of row b's i-th new token: it attends to context
    tokens `0..query_pos` (causal). No [B, Lmax, Kmax] mask exists: at long context it would be
    the largest tensor of a step, and attention builds what it needs from `query_pos`.
    """

    token_index: torch.Tensor  # [B, Lmax] long
    valid: torch.Tensor  # [B, Lmax] bool
    lengths: list[int]
    state_slots: torch.Tensor  # [B] long, KDA slot of each row
    kv_index: torch.Tensor  # [B, Kmax] long
    query_pos: torch.Tensor  # [B, Lmax] long
    slot_ids: list[int] = field(default_factory=list)  # state_slots on the host (ReplaySSM's ring counts)

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def max_len(self) -> int:
        return int(self.token_index.shape[1])


@dataclass
class ForwardBatch:
    """One step's flat batch: token ids, where their latents go, which rows need logits."""

    input_ids: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: KV pool row each new token's latent is written to
    logits_indices: torch.Tensor  # [R] long: flat positions whose logits are wanted
    single: TokenGroup | None  # rows with exactly one new token (flat positions 0..D-1)
    multi: TokenGroup | None  # rows with several new tokens
    after_layer: Callable[[int], None] | None = None  # called with each layer id once it has run

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
