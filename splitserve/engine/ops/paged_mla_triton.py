"""Paged MLA attention as a Triton kernel: reads the KV pool through `kv_index`, no dense copy.

One program owns one row `b`, a block of `BLOCK_M` (token, head) pairs of that row (pair
m = i * H + h, so a decode row's heads share one program and one read of each key), and one
split of the context. It walks its split in `BLOCK_N` key tiles, loading each pool row once
for all its heads (one shared latent KV head), with an online softmax in fp32. Splits
(flash-decoding) keep a long-context decode with few rows busy on every SM; a second launch
merges their partial results by log-sum-exp and writes each real token's rows of the output. Under `TRITON_INTERPRET=1` the same kernel runs on
CPU tensors, which is how the CPU tests check it against `paged_mla_torch`. The pair blocks are the
grid's first axis (up to 2^31 - 1 programs; the other two stop at 65,535): a prefill chunk of
L tokens has L * heads / BLOCK_M of them, 65,536 for a 32k chunk of a 32-head model.

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
    q_rope_ptr,
    kv_ptr,
    kv_index_ptr,
    token_index_ptr,
    query_pos_ptr,
    acc_ptr,
    lse_ptr,
    stride_qt,
    stride_qh,
    stride_rt,
    stride_rh,
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
    block = tl.program_id(0)  # the longest axis first: grid axes 1 and 2 stop at 65,535 programs
    b = tl.program_id(1)
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
    rope_base = q_rope_ptr + tok[:, None] * stride_rt + head[:, None] * stride_rh
    q_rope = tl.load(rope_base + offs_p[None, :], mask=m_ok[:, None] & p_ok[None, :], other=0.0)

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


def _merge_kernel(
    acc_ptr,
    lse_ptr,
    out_ptr,
    token_index_ptr,
    valid_ptr,
    stride_as,
    stride_ab,
    stride_am,
    stride_ls,
    stride_lb,
    stride_tb,
    stride_vb,
    stride_ot,
    stride_oh,
    num_heads,
    num_pairs,
    num_splits,
    rank,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Each (token, head) pair's splits merged by log-sum-exp, written to its token's row of the output.
    The splits are walked twice (their largest log-sum-exp, then the weighted sum): no tile as wide
    as the number of splits, so one binary serves every context."""
    b = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < num_pairs
    tok_i = offs_m // num_heads
    head = offs_m % num_heads
    real = tl.load(valid_ptr + b * stride_vb + tok_i, mask=m_ok, other=0) != 0
    tok = tl.load(token_index_ptr + b * stride_tb + tok_i, mask=m_ok, other=0)
    lse_base = lse_ptr + b * stride_lb + offs_m
    top = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for split in range(0, num_splits):
        top = tl.maximum(top, tl.load(lse_base + split * stride_ls, mask=m_ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty split weighs 0
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    merged = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for split in range(0, num_splits):
        weight = tl.exp(tl.load(lse_base + split * stride_ls, mask=m_ok, other=float("-inf")) - top)
        part = tl.load(
            acc_ptr + split * stride_as + b * stride_ab + offs_m[:, None] * stride_am + offs_r[None, :],
            mask=m_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        total += weight
        merged += weight[:, None] * part
    merged = merged / tl.where(total > 0.0, total, 1.0)[:, None]
    out = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_r[None, :]
    tl.store(out, merged.to(out_ptr.dtype.element_ty), mask=(m_ok & real)[:, None] & r_ok[None, :])


# the integer arguments that change with a step's rows (lengths, context widths, splits): unspecialised,
# so one binary of each serves every step (a request never compiles one; engine/warm_up.py)
_PER_STEP = ("stride_tb", "stride_as", "stride_ab", "stride_ls", "stride_lb", "num_pairs")
_KERNEL = TritonKernel(
    "paged_mla", _paged_mla_kernel, (*_PER_STEP, "stride_ib", "stride_pb", "context_len", "split_len")
)
_MERGE = TritonKernel("paged_mla_merge", _merge_kernel, (*_PER_STEP, "stride_vb", "stride_oh", "num_splits"))


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
    latent, rope = q_full[..., :rank], q_full[..., rank:]
    paged_mla_triton_split(latent, rope, kv_pool, group, scale, out_latent, block_m, block_n, num_splits)


def paged_mla_triton_split(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_pool: torch.Tensor,
    group: TokenGroup,
    scale: float,
    out_latent: torch.Tensor,
    block_m: int = 16,
    block_n: int = 32,
    num_splits: int | None = None,
    num_warps: int = 4,
) -> None:
    """`paged_mla_triton` with the query's latent [T, H, rank] and rope [T, H, rope] parts apart, each
    read in place through its strides (no concatenated copy), as is `out_latent` [T, H, rank]: two
    launches, attention over the context's splits and their merge into the group's tokens' rows."""
    rows, length, heads = group.num_rows, group.max_len, q_latent.shape[1]
    rank, rope = q_latent.shape[2], q_rope.shape[2]
    context_len = group.kv_index.shape[1]
    num_pairs = length * heads
    num_blocks = triton.cdiv(num_pairs, block_m)
    if num_splits is None:
        num_splits = _num_splits(rows * num_blocks, context_len, block_n)
    split_len = triton.cdiv(triton.cdiv(context_len, num_splits), block_n) * block_n
    acc = torch.empty(num_splits, rows, num_pairs, rank, dtype=torch.float32, device=q_latent.device)
    lse = torch.empty(num_splits, rows, num_pairs, dtype=torch.float32, device=q_latent.device)
    kv_index = group.kv_index.contiguous()
    token_index = group.token_index.contiguous()
    query_pos = group.query_pos.contiguous()
    valid = group.valid.contiguous().view(torch.int8)  # bool read as bytes
    for t in (q_latent, q_rope, kv_pool, out_latent):
        assert t.stride(-1) == 1, "the query parts, kv_pool and out_latent need a contiguous last dim"
    block_r = max(16, triton.next_power_of_2(rank))
    _KERNEL[(num_blocks, rows, num_splits)](
        q_latent,
        q_rope,
        kv_pool,
        kv_index,
        token_index,
        query_pos,
        acc,
        lse,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
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
        BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(max(rope, 1))),
        IEEE=q_latent.dtype == torch.float32,
        num_warps=num_warps,
    )
    # no boolean mask (its nonzero would sync with the host, and could not run inside a CUDA graph,
    # engine/cuda_graph.py): the merge writes each pair whose token is real to that token's row
    _MERGE[(num_blocks, rows)](
        acc,
        lse,
        out_latent,
        token_index,
        valid,
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        lse.stride(0),
        lse.stride(1),
        token_index.stride(0),
        valid.stride(0),
        out_latent.stride(0),
        out_latent.stride(1),
        heads,
        num_pairs,
        num_splits,
        rank,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
    )


def _write_kv_kernel(
    kv_ptr,
    w_ptr,
    pool_ptr,
    slot_ptr,
    rank,
    rope,
    stride_kv,
    stride_pool,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One token's pool row: its latent RMS-normalised (as ops/norms.py), then its rope key part."""
    t = tl.program_id(0).to(tl.int64)
    row = pool_ptr + tl.load(slot_ptr + t).to(tl.int64) * stride_pool
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    latent = tl.load(kv_ptr + t * stride_kv + offs_r, mask=r_ok, other=0.0)
    x32 = latent.to(tl.float32)
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / rank + eps)).to(latent.dtype)
    w = tl.load(w_ptr + offs_r, mask=r_ok, other=0.0)
    normed = (w.to(tl.float32) * normed.to(tl.float32)).to(w.dtype)  # the norm's dtype, then the pool's
    tl.store(row + offs_r, normed.to(pool_ptr.dtype.element_ty), mask=r_ok)
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < rope
    k_rope = tl.load(kv_ptr + t * stride_kv + rank + offs_p, mask=p_ok, other=0.0)
    tl.store(row + rank + offs_p, k_rope.to(pool_ptr.dtype.element_ty), mask=p_ok)


_WRITE_KV = TritonKernel("mla_write_kv", _write_kv_kernel)


def write_kv_triton(
    kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, kv_pool: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as `write_kv_torch` (ops/paged_mla.py), one launch."""
    rank = norm_weight.shape[0]
    rope = kv.shape[1] - rank
    assert kv.stride(1) == kv_pool.stride(1) == 1 and norm_weight.dtype == kv.dtype
    if kv.shape[0]:
        _WRITE_KV[(kv.shape[0],)](
            kv,
            norm_weight,
            kv_pool,
            slot_mapping,
            rank,
            rope,
            kv.stride(0),
            kv_pool.stride(0),
            eps,
            BLOCK_R=triton.next_power_of_2(rank),
            BLOCK_P=max(2, triton.next_power_of_2(max(rope, 1))),
            num_warps=4,
        )


def warm_up(norm_weight: torch.Tensor, num_heads: int, nope: int, rope: int, num_rows: int) -> None:
    """Launch the KV write, the attention and the merge once for `num_rows` decode rows of 16 context
    tokens, on zeros laid out as the MLA layer's (the query's rope part a slice of its projection, the
    latent part and the output head-major)."""
    rank, dev, dtype = norm_weight.shape[0], norm_weight.device, norm_weight.dtype
    kv = torch.zeros(num_rows, rank + rope, dtype=dtype, device=dev)
    pool = torch.zeros(16 * num_rows, rank + rope, dtype=dtype, device=dev)
    rows = torch.arange(num_rows, device=dev)
    write_kv_triton(kv, norm_weight, 1e-6, pool, rows)
    group = TokenGroup(
        token_index=rows.view(-1, 1),
        valid=torch.ones(num_rows, 1, dtype=torch.bool, device=dev),
        lengths=[1] * num_rows,
        state_slots=rows,
        kv_index=torch.arange(16 * num_rows, device=dev).view(num_rows, 16),
        query_pos=torch.full((num_rows, 1), 15, device=dev),
    )
    q = torch.zeros(num_rows, num_heads, nope + rope, dtype=dtype, device=dev)
    q_latent = torch.zeros(num_heads, num_rows, rank, dtype=dtype, device=dev).transpose(0, 1)
    out = torch.empty(num_heads, num_rows, rank, dtype=dtype, device=dev).transpose(0, 1)
    paged_mla_triton_split(q_latent, q[..., nope:], pool, group, 1.0, out)
