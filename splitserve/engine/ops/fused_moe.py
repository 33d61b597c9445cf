"""Fused MoE in Triton: the CUDA path of the routed experts (torch reference: ops/moe_reference.py).

The (token, choice) pairs are sorted by expert on the device, each expert's run padded to a
multiple of `BLOCK_M`, so every block of rows belongs to one expert. One grouped-GEMM kernel
then runs twice: `silu(x w1) * (x w3)` into an [P, I] buffer (gate and up tiles in the same
program), then `h w2` times the routing weight into [P, H]; a token's `k` rows are summed last.
The launch grid is sized from the upper bound on padded rows, so nothing waits for the host
(blocks past the end exit at once) and the whole call can be captured in a CUDA graph.

`triton` is imported only when a kernel is first used: a node without it runs the torch path.
Set `TRITON_INTERPRET=1` before the first import to run the kernel on CPU tensors (tests).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here (CUDA builds of torch bring it; `splitserve[engine]` on Linux)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def align_by_expert(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids sorted by expert, each expert's run padded to `block_m`, and each block's expert.

    Returns `sorted_pairs` [num_blocks * block_m] (pair `p = t * k + j`; padding holds `P`,
    the number of pairs) and `block_expert` [num_blocks] (-1 for blocks past the last run).
    `num_blocks` depends only on the shapes, never on the routing.
    """
    flat = expert_ids.reshape(-1)
    num_pairs, dev = flat.numel(), flat.device
    # not bincount: on CUDA it reads the largest id back to the host to size its output
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=dev) - (counts.cumsum(0) - counts)[sorted_experts]
    num_blocks = -(-(num_pairs + num_experts * (block_m - 1)) // block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.long, device=dev)
    sorted_pairs[(run_ends - padded)[sorted_experts] + rank] = order
    block_starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(run_ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert


# `fused_moe` aligns with one Triton launch instead of ~20 torch ops (each a launch, ~50 us of host
# time eagerly and a few us of device time in a graph) while pairs x experts (rounded up to a power of
# two) stays under this: each of its programs compares every pair with every expert, which stops
# paying for large prefill steps (the torch ops' sort scales better there).
ALIGN_KERNEL_MAX_WORK = 1 << 17
_align_kernel_failed = False


def align_by_expert_triton(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s exact result from two fills and one launch (one program per expert: it
    counts every expert's pairs, so it knows where its padded run starts, then writes its pairs in
    order and its blocks' expert id); no host sync, so a CUDA graph can hold it."""
    import triton

    flat = expert_ids.reshape(-1).contiguous()
    num_pairs, dev = flat.numel(), flat.device
    num_blocks = -(-(num_pairs + num_experts * (block_m - 1)) // block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.long, device=dev)
    block_expert = torch.full((num_blocks,), -1, dtype=torch.long, device=dev)
    block_e = triton.next_power_of_2(num_experts)
    _align_kernel()[(num_experts,)](
        flat,
        sorted_pairs,
        block_expert,
        num_pairs,
        BLOCK_M=block_m,
        BLOCK_P=max(16, 8192 // block_e),
        BLOCK_E=block_e,
    )
    return sorted_pairs, block_expert


def _align(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton alignment for small calls, the torch one otherwise or once the kernel failed to build."""
    global _align_kernel_failed
    work = expert_ids.numel() * (1 << (num_experts - 1).bit_length())
    if work <= ALIGN_KERNEL_MAX_WORK and not _align_kernel_failed:
        try:
            return align_by_expert_triton(expert_ids, num_experts, block_m)
        except Exception:  # a build error costs launches, not the step: the torch path is exact too
            logger.exception("the MoE alignment kernel failed; aligning with torch ops from now on")
            _align_kernel_failed = True
    return align_by_expert(expert_ids, num_experts, block_m)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """Same contract as `moe_experts_torch`: x [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]."""
    num_tokens, top_k = expert_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    sorted_pairs, block_expert = _align(expert_ids, num_experts, block_m)
    x = x.contiguous()
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _launch(x, w13, h, sorted_pairs, block_expert, num_pairs, inter, hidden, top_k, block_m, None)
    per_choice = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # rounded as the reference
    flat_weights = weights.reshape(-1).float().contiguous()
    _launch(h, w2, per_choice, sorted_pairs, block_expert, num_pairs, hidden, inter, 1, block_m, flat_weights)
    return per_choice.view(num_tokens, top_k, hidden).sum(dim=1)


def _launch(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    n: int,
    k: int,
    rows_per_a: int,
    block_m: int,
    pair_weights: torch.Tensor | None,
) -> None:
    """`out[p] = f(a[p // rows_per_a] @ w[e(p)].T)`; gated (w holds gate; up) when no weights given."""
    import triton

    kernel = _kernel()
    block_n, block_k = 64, 64
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    gated = pair_weights is None
    kernel[grid](
        a,
        w,
        out,
        sorted_pairs,
        block_expert,
        out if pair_weights is None else pair_weights,
        num_pairs,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        ROWS_PER_A=rows_per_a,
        GATED=gated,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4,
    )


@functools.cache
def _kernel() -> Callable[..., Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_gemm(
        a_ptr,
        w_ptr,
        out_ptr,
        sorted_pairs_ptr,
        block_expert_ptr,
        pair_weights_ptr,
        num_pairs,
        n,
        k,
        stride_a,
        stride_we,
        stride_wn,
        stride_wk,
        stride_out,
        ROWS_PER_A: tl.constexpr,
        GATED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        expert = tl.load(block_expert_ptr + tl.program_id(0))
        if expert >= 0:
            offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
            pairs = tl.load(sorted_pairs_ptr + offs_m)
            row_ok = pairs < num_pairs
            a_rows = pairs // ROWS_PER_A
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = offs_n < n
            offs_k = tl.arange(0, BLOCK_K)
            w_base = w_ptr + expert.to(tl.int64) * stride_we
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, k, BLOCK_K):
                k_ok = (k0 + offs_k) < k
                a = tl.load(
                    a_ptr + a_rows[:, None] * stride_a + (k0 + offs_k)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                w_offs = offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk
                w_mask = k_ok[:, None] & col_ok[None, :]
                w_tile = tl.load(w_base + w_offs, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
                acc = tl.dot(a, w_tile, acc, input_precision=DOT_PRECISION)
                if GATED:
                    up_tile = tl.load(w_base + n * stride_wn + w_offs, mask=w_mask, other=0.0)
                    acc_up = tl.dot(a, up_tile, acc_up, input_precision=DOT_PRECISION)
            if GATED:
                acc = acc * tl.sigmoid(acc) * acc_up
            else:
                acc = acc * tl.load(pair_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
            tl.store(
                out_ptr + pairs[:, None] * stride_out + offs_n[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & col_ok[None, :],
            )

    return grouped_gemm


@functools.cache
def _align_kernel() -> Callable[..., Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def align(
        expert_ids_ptr,
        sorted_pairs_ptr,
        block_expert_ptr,
        num_pairs,
        BLOCK_M: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        expert = tl.program_id(0)
        offs_e = tl.arange(0, BLOCK_E)
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for p0 in range(0, num_pairs, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            ids = tl.load(expert_ids_ptr + offs, mask=offs < num_pairs, other=-1)
            counts += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        start = tl.sum(tl.where(offs_e < expert, padded, 0))  # where this expert's padded run begins
        num_blocks = tl.sum(tl.where(offs_e == expert, padded, 0)) // BLOCK_M
        seen = 0
        for p0 in range(0, num_pairs, BLOCK_P):  # this expert's pairs, in pair order (a stable sort)
            offs = p0 + tl.arange(0, BLOCK_P)
            ids = tl.load(expert_ids_ptr + offs, mask=offs < num_pairs, other=-1)
            mine = (ids == expert).to(tl.int32)
            rank = seen + tl.cumsum(mine, axis=0) - 1
            tl.store(sorted_pairs_ptr + start + rank, offs.to(tl.int64), mask=mine > 0)
            seen += tl.sum(mine, axis=0)
        for b0 in range(0, num_blocks, BLOCK_M):
            offs_b = b0 + tl.arange(0, BLOCK_M)
            value = tl.zeros([BLOCK_M], dtype=tl.int64) + expert
            tl.store(block_expert_ptr + start // BLOCK_M + offs_b, value, mask=offs_b < num_blocks)

    return align
