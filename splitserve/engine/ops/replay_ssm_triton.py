"""ReplaySSM's decode step as a Triton kernel: reads the checkpoint pool and the ring by slot,
writes this step's record, and writes the checkpoint only when the ring fills (the fold).

One program owns one row, one head and a block of `BLOCK_V` value columns; it holds that head's
whole key dimension (`BLOCK_K`). It reads the checkpoint tile once, walks the row's held records
(a loop bounded by the row's count, so a young window costs less), and computes `u` and the
output exactly as `replay_step` (ops/replay_ssm.py) does. The record's `k` and `G` are written by
the programs of value block 0; every program writes its columns of `u` and, on a fold, of the new
checkpoint (`rebuild` of every record, the current one taken from registers). The slot's state
is not written on any other step, which is what the ring form saves over the plain recurrent
kernel. Under `TRITON_INTERPRET=1` it runs on CPU tensors (how the tests check it).
Each row's record count is read from a device tensor (one per row) and nothing is decided on the
host, so a CUDA graph of the decode step replays the append and the fold. The kernel is a
`TritonKernel` (ops/triton_kernel.py): jitted on first use per interpreter mode, stubbed and counted
on the CPU like the others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.ops.triton_kernel import TritonKernel


def _replay_step_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    ckpt_ptr,
    ring_k_ptr,
    ring_u_ptr,
    ring_g_ptr,
    index_ptr,
    count_ptr,
    out_ptr,
    num_heads,
    dk,
    dv,
    window,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(index_ptr + n).to(tl.int64)
    count = tl.load(count_ptr + n).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < dk
    v_ok = offs_v < dv
    row_k = (n * num_heads + h) * dk + offs_k  # q, k, g: [N, H, Dk] contiguous
    q = tl.load(q_ptr + row_k, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row_k, mask=k_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row_k, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + (n * num_heads + h) * dv + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + n * num_heads + h).to(tl.float32)

    # ring layout [slots, L, H, D]: record j of this slot and head starts at ring_base(j) * D
    head_base = slot * window * num_heads + h
    prev = tl.maximum(count - 1, 0)
    g_prev = tl.load(ring_g_ptr + (head_base + prev * num_heads) * dk + offs_k, mask=k_ok, other=0.0)
    g_prev = tl.where(count > 0, g_prev, 0.0)  # G_0 = 0 (record 0 of an empty ring is a past window's)
    g_now = g_prev + g

    ckpt = ckpt_ptr + (slot * num_heads + h) * dk * dv + offs_k[:, None] * dv + offs_v[None, :]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    s0 = tl.load(ckpt, mask=tile_ok, other=0.0)
    decay = tl.exp(g_now)
    kv_mem = tl.sum(s0 * (decay * k)[:, None], axis=0)
    out = tl.sum(s0 * (decay * q)[:, None], axis=0)
    for j in range(0, count):
        base = head_base + j * num_heads
        kj = tl.load(ring_k_ptr + base * dk + offs_k, mask=k_ok, other=0.0)
        gj = tl.load(ring_g_ptr + base * dk + offs_k, mask=k_ok, other=0.0)
        uj = tl.load(ring_u_ptr + base * dv + offs_v, mask=v_ok, other=0.0)
        wk = kj * tl.exp(g_now - gj)
        kv_mem += tl.sum(wk * k) * uj
        out += tl.sum(wk * q) * uj
    u = (v - kv_mem) * beta
    out += tl.sum(k * q) * u
    tl.store(out_ptr + (n * num_heads + h) * dv + offs_v, out, mask=v_ok)

    here = head_base + count * num_heads
    tl.store(ring_u_ptr + here * dv + offs_v, u, mask=v_ok)
    if vb == 0:
        tl.store(ring_k_ptr + here * dk + offs_k, k, mask=k_ok)
        tl.store(ring_g_ptr + here * dk + offs_k, g_now, mask=k_ok)
    if count + 1 == window:  # the ring is full: fold every record into the checkpoint
        state = s0 * decay[:, None] + k[:, None] * u[None, :]
        for j in range(0, count):
            base = head_base + j * num_heads
            kj = tl.load(ring_k_ptr + base * dk + offs_k, mask=k_ok, other=0.0)
            gj = tl.load(ring_g_ptr + base * dk + offs_k, mask=k_ok, other=0.0)
            uj = tl.load(ring_u_ptr + base * dv + offs_v, mask=v_ok, other=0.0)
            state += (kj * tl.exp(g_now - gj))[:, None] * uj[None, :]
        tl.store(ckpt, state, mask=tile_ok)


REPLAY_STEP = TritonKernel("replay_step", _replay_step_kernel)


def replay_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    checkpoint: torch.Tensor,
    ring_k: torch.Tensor,
    ring_u: torch.Tensor,
    ring_g: torch.Tensor,
    index: torch.Tensor,
    count: torch.Tensor,
    block_v: int = 32,
) -> torch.Tensor:
    """One decode step of rows in slots `index` holding `count` records each (< window; int32 or
    int64, on the device).

    Pools: checkpoint [slots, H, Dk, Dv], rings [slots, L, H, D], all fp32 and contiguous; they are
    updated in place (the record at `count`; the checkpoint of rows whose ring fills). Returns the
    output [N, H, Dv] fp32. The caller keeps the counts (count + 1, or 0 after a fold).
    """
    rows, heads, dk = k.shape
    dv = v.shape[-1]
    for pool in (checkpoint, ring_k, ring_u, ring_g):
        assert pool.dtype == torch.float32 and pool.is_contiguous(), "ReplaySSM pools are fp32, contiguous"
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = torch.empty(rows, heads, dv, dtype=torch.float32, device=q.device)
    block_v = min(block_v, triton.next_power_of_2(dv))
    grid = (rows, heads, triton.cdiv(dv, block_v))
    REPLAY_STEP[grid](
        q,
        k,
        v,
        g,
        beta,
        checkpoint,
        ring_k,
        ring_u,
        ring_g,
        index.contiguous(),
        count.contiguous(),
        out,
        heads,
        dk,
        dv,
        ring_k.shape[1],
        BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
    )
    return out
