"""RMSNorm (optionally after the residual add), and KDA's gated output norm, each one Triton launch.

Same arithmetic as ops/norms.py's references. RMSNorm: one program per row; the sum rounded to the
stream's dtype and stored, fp32 statistics, the normalised row rounded to that dtype, then times the
weight and rounded to the output dtype. Gated norm: one program per `BLOCK_R` rows (heads) of one
head's width. No host sync, shapes from the inputs only: a CUDA graph can hold either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.ops.triton_kernel import TritonKernel


def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_cols,
    stride_x,
    stride_res,
    stride_out,
    stride_sum,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * tl.rsqrt(mean_sq + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _gated_rms_norm_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    n_cols,
    stride_x,
    stride_gate,
    stride_out,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x32 = x.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded to the model dtype first
    mean_sq = tl.sum(x32 * x32, axis=1) / n_cols
    x32 = x32 * tl.rsqrt(mean_sq + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0)
    out = w[None, :] * x32 * tl.sigmoid(gate.to(tl.float32))
    tl.store(
        out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask
    )


_KERNEL = TritonKernel("rms_norm", _rms_norm_kernel)
_GATED_KERNEL = TritonKernel("gated_rms_norm", _gated_rms_norm_kernel)


def rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(rms_norm(s), s)` with `s = residual + x` (or `(rms_norm(x), None)` without a residual)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    norm_dtype = x.dtype if residual is None else torch.promote_types(residual.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, norm_dtype), device=x.device)
    summed = None if residual is None else torch.empty(rows.shape, dtype=norm_dtype, device=x.device)
    res_rows = rows if residual is None else residual.reshape(-1, n)
    if res_rows.stride(-1) != 1:
        res_rows = res_rows.contiguous()
    block = triton.next_power_of_2(n)
    if rows.shape[0]:
        _KERNEL[(rows.shape[0],)](
            rows,
            res_rows,
            weight,
            out,
            out if summed is None else summed,
            n,
            rows.stride(0),
            res_rows.stride(0),
            out.stride(0),
            out.stride(0) if summed is None else summed.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=4 if block <= 1024 else (8 if block <= 4096 else 16),
        )
    shape = (*x.shape[:-1], n)
    return out.view(shape), None if summed is None else summed.view(shape)


def gated_rms_norm_triton(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """`gated_rms_norm_torch`'s result: x, gate [..., D] -> [..., D] in `dtype`, contiguous."""
    n = x.shape[-1]
    rows, gates = x.reshape(-1, n), gate.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if gates.stride(-1) != 1:
        gates = gates.contiguous()
    out = torch.empty(rows.shape, dtype=dtype, device=x.device)
    block = triton.next_power_of_2(n)
    block_r = max(1, min(16, 4096 // block))
    if rows.shape[0]:
        _GATED_KERNEL[(triton.cdiv(rows.shape[0], block_r),)](
            rows,
            gates,
            weight,
            out,
            rows.shape[0],
            n,
            rows.stride(0),
            gates.stride(0),
            out.stride(0),
            eps,
            BLOCK_R=block_r,
            BLOCK=block,
            num_warps=4,
        )
    return out.view(x.shape)


def warm_up(
    norm_weight: torch.Tensor, gated_weight: torch.Tensor | None, num_heads: int, num_rows: int
) -> None:
    """Launch each norm once for `num_rows` tokens: RMSNorm with and without the residual add (over
    `norm_weight`'s width and dtype) and, given KDA's `gated_weight`, its gated norm of `num_heads` fp32 heads."""
    x = torch.zeros(num_rows, norm_weight.shape[0], dtype=norm_weight.dtype, device=norm_weight.device)
    rms_norm_triton(x, None, norm_weight, 1e-6)
    rms_norm_triton(x, x, norm_weight, 1e-6)
    if gated_weight is not None:
        core = torch.zeros(num_rows, num_heads, gated_weight.shape[0], device=gated_weight.device)
        gated_rms_norm_triton(core, core.to(gated_weight.dtype), gated_weight, 1e-6, gated_weight.dtype)
