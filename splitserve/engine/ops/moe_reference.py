"""Routed experts in plain torch: the CPU path and the reference the Triton kernel is tested against.

The (token, choice) pairs are sorted by expert and packed into a zero-padded `[E, C, H]` buffer
(`C` the busiest expert's count), so both expert matmuls are one `bmm` each whatever the number
of experts: a dozen ops per layer instead of eight per expert. Where routing is skewed enough
that the padding would cost more than the loop's per-expert overhead (long prefill chunks), a
per-expert loop over the same sorted pairs runs instead. Both combine a token's `k` expert outputs in the order of its choices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Padding the bmm may add before the per-expert loop is cheaper: a quarter of the real rows, plus
# what the loop's own per-expert op overhead costs (~32 rows of compute per expert at small shapes).
_PADDING_FRACTION = 0.25
_PADDING_ROWS_PER_EXPERT = 32


def moe_experts_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """`sum_j weights[t, j] * w2[e] @ (silu(gate) * up)`, `gate; up = w13[e] @ x[t]`, `e = expert_ids[t, j]`.

    x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; weights: [T, k] (fp32); expert_ids: [T, k].
    Returns [T, H] in x's dtype.
    """
    num_tokens, top_k = expert_ids.shape
    num_experts = w13.shape[0]
    if num_tokens == 0:
        return torch.zeros_like(x)
    flat_ids = expert_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts)
    capacity = int(counts.max())
    allowed_rows = (1 + _PADDING_FRACTION) * flat_ids.numel() + _PADDING_ROWS_PER_EXPERT * num_experts
    if num_experts * capacity > allowed_rows:
        return _per_expert_loop(x, w13, w2, weights, order, counts.tolist(), top_k)
    # row of each pair in the padded buffer: its expert's block, then its rank among that expert's pairs
    starts = counts.cumsum(0) - counts
    sorted_ids = flat_ids[order]
    slot_sorted = sorted_ids * capacity + torch.arange(order.numel(), device=x.device) - starts[sorted_ids]
    slot = torch.empty_like(slot_sorted)
    slot[order] = slot_sorted  # slot of pair p = t * k + j
    buffer = x.new_zeros(num_experts * capacity, x.shape[1])
    buffer[slot] = x.repeat_interleave(top_k, dim=0)
    gate_up = torch.bmm(buffer.view(num_experts, capacity, -1), w13.transpose(1, 2))
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2)).view(num_experts * capacity, -1)
    per_choice = y[slot].view(num_tokens, top_k, -1)
    # weight in fp32, round each choice to x's dtype, then sum: transformers' rounding in bf16
    return (per_choice * weights.unsqueeze(-1)).to(x.dtype).sum(dim=1)


def _per_expert_loop(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    order: torch.Tensor,
    counts: list[int],
    top_k: int,
) -> torch.Tensor:
    out = torch.zeros_like(x)
    token_of = order // top_k
    weight_of = weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weight_of[start : start + count, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out
