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

    `valid_index` (built on the host by the runner) lists the flat positions `b * Lmax + i` of the
    real tokens, row-major: `real_tokens` gathers them with it instead of a boolean mask, whose
    `nonzero` would make the host wait for the device (once per layer on CUDA). Without it (a group
    built by hand) the mask is used; a group whose rows are all full needs neither.
    """

    token_index: torch.Tensor  # [B, Lmax] long
    valid: torch.Tensor  # [B, Lmax] bool
    lengths: list[int]
    state_slots: torch.Tensor  # [B] long, KDA slot of each row
    kv_index: torch.Tensor  # [B, Kmax] long
    query_pos: torch.Tensor  # [B, Lmax] long
    slot_ids: list[int] = field(default_factory=list)  # state_slots on the host (ReplaySSM's torch folds)
    # ReplaySSM: records each row's ring holds ([B] long, on the device; None without rings)
    replay_counts: torch.Tensor | None = None
    valid_index: torch.Tensor | None = None  # [num real tokens] long, see above; None: all full or unknown
    starts: list[int] = field(default_factory=list)  # token_index[:, 0] on the host (empty: unknown)
    # what attention layers derive from the group once per step and share (e.g. the torch MLA
    # path's additive causal mask): filled by the ops, keyed by them
    derived: dict[object, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def max_len(self) -> int:
        return int(self.token_index.shape[1])

    @property
    def is_full(self) -> bool:
        """Every row has `max_len` new tokens (a decode group): `valid` is all True."""
        return all(n == self.max_len for n in self.lengths)

    def real_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """`x[valid]` for `x` [B, Lmax, ...]: its real entries in row-major order, without a host sync
        when the group is full or has `valid_index`."""
        flat = x.reshape(-1, *x.shape[2:])
        if self.is_full:
            return flat
        if self.valid_index is None:
            return x[self.valid]  # a boolean mask: nonzero syncs with the host on CUDA
        return flat.index_select(0, self.valid_index)

    def real_token_index(self) -> torch.Tensor:
        """`token_index[valid]`: the flat batch position of each real token, in the same order."""
        return self.real_tokens(self.token_index)


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
