"""Paged MLA attention as a Triton kernel: reads the KV pool through `kv_index`, no dense copy.

One program owns one row `b`, a block of `BLOCK_M` (token, head) pairs of that row (pair
m = i * H + h, so a decode row's heads share one program and one read of each key), and one
split of the context. It walks its split in `BLOCK_N` key tiles, loading each pool row once
for all its heads (one shared latent KV head), with an online softmax in fp32. Splits
(flash-decoding) keep a long-context decode with few rows busy on every SM; their partial
results are merged by log-sum-exp in torch. Under `TRITON_INTERPRET=1` the same kernel runs on
CPU tensors, which is how the CPU tests check it against `paged_mla_torch`.

The kernel is decorated on first use, per interpreter mode (ops/triton_kernel.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.forward_batch import TokenGroup
from splitserve.engine.ops.triton_kernel import TritonKernel

# enough programs to cover an H200's 132 SMs twice before splitting a row's context further
TARGET_PROGRAMS = 264
MIN_SPLIT_TOKENS = 256


def _paged_mla_kernel(
    q_ptr,
    kv_ptr,
    kv_index_ptr,
    token_index_ptr,
    query_pos_ptr,
    acc_ptr,
    lse_ptr,
    stride_qt,
    stride_qh,
    stride_kvn,
    stride_ib,
    stride_tb,
    stride_pb,
    stride_as,
    stride_ab,
    stride_am,
    stride_ls,
    stride_lb,
    num_heads,
    num_pairs,
    context_len,
    rank,
    rope,
    split_len,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    block = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < num_pairs
    tok_i = offs_m // num_heads
    head = offs_m % num_heads
    tok = tl.load(token_index_ptr + b * stride_tb + tok_i, mask=m_ok, other=0)
    qpos = tl.load(query_pos_ptr + b * stride_pb + tok_i, mask=m_ok, other=-1)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_ok = offs_r < rank
    p_ok = offs_p < rope
    q_base = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
    q_rope = tl.load(q_base + rank + offs_p[None, :], mask=m_ok[:, None] & p_ok[None, :], other=0.0)

    start = split * split_len
    stop = tl.minimum(tl.minimum(start + split_len, context_len), tl.max(qpos) + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        rows = tl.load(kv_index_ptr + b * stride_ib + offs_n, mask=n_ok, other=0)
        kv_base = kv_ptr + rows[:, None] * stride_kvn
        k_lat = tl.load(kv_base + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        k_rope = tl.load(kv_base + rank + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0.0)
        if IEEE:
            scores = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
            scores += tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee")
        else:
            scores = tl.dot(q_lat, tl.trans(k_lat)) + tl.dot(q_rope, tl.trans(k_rope))
        allowed = (offs_n[None, :] <= qpos[:, None]) & n_ok[None, :]
        scores = tl.where(allowed, scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, k_lat.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat)
        m_i = m_new
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    acc_out = acc_ptr + split * stride_as + b * stride_ab + offs_m[:, None] * stride_am + offs_r[None, :]
    tl.store(acc_out, out, mask=m_ok[:, None] & r_ok[None, :])
    tl.store(lse_ptr + split * stride_ls + b * stride_lb + offs_m, lse, mask=m_ok)


_KERNEL = TritonKernel("paged_mla", _paged_mla_kernel)


def _num_splits(num_programs: int, context_len: int, block_n: int) -> int:
    """Context splits per row: enough programs to fill the device, each split >= MIN_SPLIT_TOKENS."""
    if num_programs >= TARGET_PROGRAMS:
        return 1
    most = max(1, context_len // max(MIN_SPLIT_TOKENS, block_n))
    return max(1, min(most, triton.cdiv(TARGET_PROGRAMS, num_programs)))


def paged_mla_triton(
    q_full: torch.Tensor,
    kv_pool: torch.Tensor,
    group: TokenGroup,
    rank: int,
    scale: float,
    out_latent: torch.Tensor,
    block_m: int = 16,
    block_n: int = 32,
    num_splits: int | None = None,
) -> None:
    """Same contract as `paged_mla_torch`; `num_splits` None picks one from the grid's size."""
    rows, length, heads = group.num_rows, group.max_len, q_full.shape[1]
    rope = q_full.shape[2] - rank
    context_len = group.kv_index.shape[1]
    num_pairs = length * heads
    num_blocks = triton.cdiv(num_pairs, block_m)
    if num_splits is None:
        num_splits = _num_splits(rows * num_blocks, context_len, block_n)
    split_len = triton.cdiv(triton.cdiv(context_len, num_splits), block_n) * block_n
    acc = torch.empty(num_splits, rows, num_pairs, rank, dtype=torch.float32, device=q_full.device)
    lse = torch.empty(num_splits, rows, num_pairs, dtype=torch.float32, device=q_full.device)
    kv_index = group.kv_index.contiguous()
    token_index = group.token_index.contiguous()
    query_pos = group.query_pos.contiguous()
    assert q_full.stride(2) == 1 and kv_pool.stride(1) == 1, "q_full and kv_pool need a contiguous last dim"
    _KERNEL[(rows, num_blocks, num_splits)](
        q_full,
        kv_pool,
        kv_index,
        token_index,
        query_pos,
        acc,
        lse,
        q_full.stride(0),
        q_full.stride(1),
        kv_pool.stride(0),
        kv_index.stride(0),
        token_index.stride(0),
        query_pos.stride(0),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        lse.stride(0),
        lse.stride(1),
        heads,
        num_pairs,
        context_len,
        rank,
        rope,
        split_len,
        scale,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_P=max(16, triton.next_power_of_2(max(rope, 1))),
        IEEE=q_full.dtype == torch.float32,
    )
    if num_splits == 1:
        merged = acc[0]
    else:  # log-sum-exp merge of the splits; an empty split has lse -inf and weight 0
        weights = torch.softmax(lse, dim=0).nan_to_num(0.0).unsqueeze(-1)
        merged = (acc * weights).sum(dim=0)
    o = merged.view(rows, length, heads, rank)  # pair m = i * H + h
    # no boolean mask (its nonzero would sync with the host, and could not run inside a CUDA graph,
    # engine/cuda_graph.py): a full group (decode) takes every entry, a ragged one its valid_index
    out_latent[group.real_token_index()] = group.real_tokens(o).to(out_latent.dtype)
