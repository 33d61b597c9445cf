"""The fused MoE's Triton kernels (their torch reference and wrappers: ops/fused_moe.py, which
imports this module only when a kernel runs, so a node without triton never imports it)."""

from __future__ import annotations

import triton.language as tl

from splitserve.engine.ops.triton_kernel import TritonKernel


def grouped_gemm(
    a_ptr,
    w_ptr,
    shared_ptr,
    out_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    pair_weights_ptr,
    num_pairs,
    num_routed,
    n,
    k,
    stride_a,
    stride_we,
    stride_wn,
    shared_step,
    stride_sn,
    shared_up,
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
        routed = expert < num_routed
        if routed:
            w_base = w_ptr + expert.to(tl.int64) * stride_we
        else:  # a shared expert's slice of the shared MLP's weights
            w_base = shared_ptr + (expert - num_routed).to(tl.int64) * shared_step
        row_stride = tl.where(routed, stride_wn, stride_sn)
        up_offset = tl.where(routed, n * stride_wn, shared_up)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            k_ok = (k0 + offs_k) < k
            a = tl.load(
                a_ptr + a_rows[:, None] * stride_a + (k0 + offs_k)[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w_offs = offs_n[None, :] * row_stride + (k0 + offs_k)[:, None]
            w_mask = k_ok[:, None] & col_ok[None, :]
            w_tile = tl.load(w_base + w_offs, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(a, w_tile, acc, input_precision=DOT_PRECISION)
            if GATED:
                up_tile = tl.load(w_base + up_offset + w_offs, mask=w_mask, other=0.0)
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


def align(
    expert_ids_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_blocks_total,
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
    # the run's padding (fewer than BLOCK_M rows) names no pair
    offs_pad = seen + tl.arange(0, BLOCK_M)
    no_pair = tl.full([BLOCK_M], num_pairs, dtype=tl.int64)
    tl.store(sorted_pairs_ptr + start + offs_pad, no_pair, mask=offs_pad < num_blocks * BLOCK_M)
    if expert == tl.num_programs(0) - 1:  # the last run's program: the blocks past every run are empty
        used = tl.sum(padded)
        for r0 in range(used, num_blocks_total * BLOCK_M, BLOCK_M):
            offs_r = r0 + tl.arange(0, BLOCK_M)
            tl.store(sorted_pairs_ptr + offs_r, no_pair, mask=offs_r < num_blocks_total * BLOCK_M)
        for b0 in range(used // BLOCK_M, num_blocks_total, BLOCK_M):
            offs_b = b0 + tl.arange(0, BLOCK_M)
            no_expert = tl.full([BLOCK_M], -1, dtype=tl.int64)
            tl.store(block_expert_ptr + offs_b, no_expert, mask=offs_b < num_blocks_total)


GROUPED_GEMM = TritonKernel("moe_grouped_gemm", grouped_gemm)
ALIGN = TritonKernel("moe_align", align)
