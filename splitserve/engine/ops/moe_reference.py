"""Routed experts in plain torch: the CPU path and the reference the Triton kernel is tested against.

The (token, choice) pairs are sorted by expert and their rows gathered once into an expert-major
buffer; each expert then runs two matmuls on its own contiguous run of rows, written in place
(`torch.mm(out=)`), while the activation, the routing weight and the un-sorting each run once
over all pairs. Nothing is padded (a padded `[E, C, H]` bmm wastes the gap between the busiest
expert and the mean), and a token's `k` expert outputs are combined in the order of its choices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """`sum_j weights[t, j] * w2[e] @ (silu(gate) * up)`, `gate; up = w13[e] @ x[t]`, `e = expert_ids[t, j]`.

    x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; weights: [T, k] (fp32); expert_ids: [T, k].
    Returns [T, H] in x's dtype. An id of E names an expert on another rank (expert parallelism):
    that choice adds nothing here.
    """
    num_tokens, top_k = expert_ids.shape
    num_experts, two_i, hidden = w13.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    flat_ids = expert_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)  # pair p = t * k + j, sorted by expert
    # the CPU path: no device sync; the last count is the choices of experts elsewhere (sorted last)
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()
    # index_select, not advanced indexing: the CPU gather of whole rows is several times faster
    rows = x.index_select(0, order // top_k)  # [P, H], expert-major
    gate_up = x.new_empty(order.numel(), two_i)
    _per_expert_mm(rows, w13, counts, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate).mul_(up)
    y = x.new_empty(order.numel(), hidden)
    _per_expert_mm(act, w2, counts, y)
    if counts[-1]:
        y[-counts[-1] :].zero_()  # no expert here computed them
    # weight in fp32, round each choice to x's dtype, then sum: transformers' rounding in bf16
    y.mul_(weights.reshape(-1)[order].unsqueeze(-1))
    unsort = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return y.index_select(0, unsort).view(num_tokens, top_k, hidden).sum(dim=1)


def _per_expert_mm(rows: torch.Tensor, w: torch.Tensor, counts: list[int], out: torch.Tensor) -> None:
    """`out[run of e] = rows[run of e] @ w[e].T` for each expert's contiguous run of rows.

    The runs and the transposed weights are split into views once (three ops, not a slice and a
    transpose per expert): at small batches the per-op overhead, not the matmuls, is the cost.
    """
    runs, outs = rows.split(counts), out.split(counts)
    for rows_e, w_t, out_e, count in zip(runs, w.transpose(1, 2).unbind(0), outs, counts):
        if count:
            torch.mm(rows_e, w_t, out=out_e)
