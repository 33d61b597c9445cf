"""RMSNorm, RMSNorm fused with the residual add before it, and KDA's gated output norm: the torch
references and the choice of backend.

`rms_norm_torch` is transformers' arithmetic: fp32 statistics, the normalised row cast back to the
input dtype, then times the weight. `add_rms_norm` first adds a sublayer's output to the residual
stream in the stream's dtype (one rounding, as `residual + x` does) and returns the new stream with
its norm. `gated_rms_norm` is KDA's output norm per head, `weight * norm(x) * sigmoid(gate)` in fp32,
on `x` rounded to the model dtype first. On CUDA (`fused_backend`) each is one Triton launch
(ops/norms_triton.py) instead of seven to twelve torch ops; the CPU runs the references.
"""

from __future__ import annotations

import torch

from splitserve.engine.ops.triton_kernel import fused_backend, kernel_or_torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x / sqrt(mean(x^2) + eps))`, statistics in fp32, cast back to x's dtype before the weight."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(residual + x), residual + x)`."""
    summed = residual + x
    return rms_norm_torch(summed, weight, eps), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_torch`'s result from the chosen backend."""
    if fused_backend(x.device) == "torch":
        return rms_norm_torch(x, weight, eps)
    from splitserve.engine.ops.norms_triton import rms_norm_triton

    return kernel_or_torch(
        "rms_norm", lambda: rms_norm_triton(x, None, weight, eps)[0], lambda: rms_norm_torch(x, weight, eps)
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_torch`'s result from the chosen backend: (the norm, the new residual stream)."""
    if fused_backend(x.device) == "torch":
        return add_rms_norm_torch(x, residual, weight, eps)
    from splitserve.engine.ops.norms_triton import rms_norm_triton

    def kernel() -> tuple[torch.Tensor, torch.Tensor]:
        out, summed = rms_norm_triton(x, residual, weight, eps)
        assert summed is not None
        return out, summed

    return kernel_or_torch("add_rms_norm", kernel, lambda: add_rms_norm_torch(x, residual, weight, eps))


def gated_rms_norm_torch(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """`weight * rms_norm(x) * sigmoid(gate)` over the last dim in fp32, `x` first rounded to `dtype`
    (the output's dtype): x, gate [..., D] -> [..., D]."""
    x32 = x.to(dtype).float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    x32 = weight.float() * x32 * torch.sigmoid(gate.float())
    return x32.to(dtype)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """`gated_rms_norm_torch`'s result from the chosen backend."""
    if fused_backend(x.device) == "torch":
        return gated_rms_norm_torch(x, gate, weight, eps, dtype)
    from splitserve.engine.ops.norms_triton import gated_rms_norm_triton

    return kernel_or_torch(
        "gated_rms_norm",
        lambda: gated_rms_norm_triton(x, gate, weight, eps, dtype),
        lambda: gated_rms_norm_torch(x, gate, weight, eps, dtype),
    )
