"""KDA's decode-step conv, L2 norms, forget gate and beta as one Triton launch (reference: ops/kda_gates.py).

One program owns one (row, head): it reads the head's q, k and v channels of the row's conv window
(the slot's last `K-1` inputs and this token), writes the window moved on by one back to the slot,
and writes the head's q, k, v, g (fp32, [N, H, D], contiguous) and beta. It rounds where the
reference stores a tensor in the model dtype (each tap's product, the conv sum, its silu, the
sigmoid of beta), so the two differ only in the order of a K-term sum. Rows that share a slot (the
decode batch's padding rows, on the scratch slot) race on it as they do in the reference; nothing
reads what they leave there. No host sync: a CUDA graph can hold it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.ops.kda_gates import KDAInputs
from splitserve.engine.ops.triton_kernel import TritonKernel


def _kda_decode_gates_kernel(
    mixed_ptr,
    f_ptr,
    b_ptr,
    state_ptr,
    w_ptr,
    slots_ptr,
    dt_bias_ptr,
    decay_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    dim,
    head_dim,
    taps,
    stride_mixed,
    stride_f,
    stride_b,
    stride_slot,
    stride_sc,
    stride_wc,
    scale,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_d = tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    d_ok = offs_d < head_dim
    dtype = mixed_ptr.dtype.element_ty
    state_row = state_ptr + tl.load(slots_ptr + row).to(tl.int64) * stride_slot
    out = (row * num_heads + head) * head_dim + offs_d
    for part in tl.static_range(3):  # q, k, v: the same head's channels in each third
        channels = part * dim + head * head_dim + offs_d
        x = tl.load(mixed_ptr + row * stride_mixed + channels, mask=d_ok, other=0.0)
        kept = d_ok[:, None] & (offs_k < taps - 1)
        slot = state_row + channels[:, None] * stride_sc + offs_k
        window = tl.load(slot, mask=kept, other=0.0)
        window = tl.where(offs_k == taps - 1, x[:, None], window)  # [D, K]: the slot's K-1 inputs, then x
        moved = tl.load(slot + 1, mask=d_ok[:, None] & (offs_k < taps - 2), other=0.0)
        moved = tl.where(offs_k == taps - 2, x[:, None], moved)
        tl.debug_barrier()  # the program's reads of these windows before its writes
        tl.store(slot, moved, mask=kept)
        w = tl.load(
            w_ptr + channels[:, None] * stride_wc + offs_k, mask=d_ok[:, None] & (offs_k < taps), other=0.0
        )
        taps_out = (window.to(tl.float32) * w.to(tl.float32)).to(dtype).to(tl.float32)
        conv = tl.sum(taps_out, axis=1).to(dtype).to(tl.float32)
        act = (conv * tl.sigmoid(conv)).to(dtype).to(tl.float32)
        if part == 0:
            tl.store(q_ptr + out, act / tl.sqrt(tl.sum(act * act, axis=0) + 1e-6) * scale, mask=d_ok)
        elif part == 1:
            tl.store(k_ptr + out, act / tl.sqrt(tl.sum(act * act, axis=0) + 1e-6), mask=d_ok)
        else:
            tl.store(v_ptr + out, act, mask=d_ok)
    channels = head * head_dim + offs_d
    g = tl.load(f_ptr + row * stride_f + channels, mask=d_ok, other=0.0).to(tl.float32)
    g += tl.load(dt_bias_ptr + channels, mask=d_ok, other=0.0)
    e = tl.exp(g)
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * e / tl.where(u == 1.0, 1.0, u - 1.0))  # accurate for small e
    g = tl.where(g > 20.0, g, log1p) * -tl.load(decay_ptr + head)
    tl.store(g_ptr + out, g, mask=d_ok)
    b = tl.load(b_ptr + row * stride_b + head).to(tl.float32)
    tl.store(beta_ptr + row * num_heads + head, tl.sigmoid(b).to(dtype).to(tl.float32))


_KERNEL = TritonKernel("kda_decode_gates", _kda_decode_gates_kernel)


def kda_decode_gates_triton(
    mixed: torch.Tensor,
    f: torch.Tensor,
    b_logit: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    slots: torch.Tensor,
    dt_bias: torch.Tensor,
    decay_rate: torch.Tensor,
    num_heads: int,
) -> KDAInputs:
    """Same contract as `kda_decode_gates` (ops/kda_gates.py)."""
    rows, dim = mixed.shape[0], mixed.shape[1] // 3
    head_dim, taps = dim // num_heads, conv_weight.shape[1]
    assert mixed.stride(1) == f.stride(1) == conv_state.stride(2) == conv_weight.stride(1) == 1
    assert dt_bias.dtype == decay_rate.dtype == torch.float32 and dt_bias.is_contiguous()
    q, k, v, g = (
        torch.empty(rows, num_heads, head_dim, dtype=torch.float32, device=mixed.device) for _ in range(4)
    )
    beta = torch.empty(rows, num_heads, dtype=torch.float32, device=mixed.device)
    if rows:
        _KERNEL[(rows, num_heads)](
            mixed,
            f,
            b_logit,
            conv_state,
            conv_weight,
            slots,
            dt_bias,
            decay_rate,
            q,
            k,
            v,
            g,
            beta,
            dim,
            head_dim,
            taps,
            mixed.stride(0),
            f.stride(0),
            b_logit.stride(0),
            conv_state.stride(0),
            conv_state.stride(1),
            conv_weight.stride(0),
            head_dim**-0.5,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_K=triton.next_power_of_2(taps),
            num_warps=4,
        )
    return q, k, v, g, beta


def warm_up(
    in_proj: torch.Tensor,
    conv_weight: torch.Tensor,
    dt_bias: torch.Tensor,
    decay_rate: torch.Tensor,
    num_heads: int,
    num_rows: int,
) -> None:
    """Launch the kernel once for `num_rows` decode rows of a KDA layer with these weights, on zero
    inputs laid out as the layer's (slices of its fused projection's output; its own conv windows)."""
    dim, taps = conv_weight.shape[0] // 3, conv_weight.shape[1]
    head_dim, dev, dtype = dim // num_heads, in_proj.device, in_proj.dtype
    proj = torch.zeros(num_rows, in_proj.shape[0], dtype=dtype, device=dev)
    f = torch.zeros(num_rows, dim, dtype=dtype, device=dev)
    state = torch.zeros(num_rows, 3 * dim, taps - 1, dtype=dtype, device=dev)
    slots = torch.arange(num_rows, device=dev)
    b_logit = proj[:, 3 * dim + head_dim : 3 * dim + head_dim + num_heads]
    kda_decode_gates_triton(
        proj[:, : 3 * dim], f, b_logit, state, conv_weight, slots, dt_bias, decay_rate, num_heads
    )
