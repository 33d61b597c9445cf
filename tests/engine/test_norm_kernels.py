"""The norm Triton kernels against their torch references: RMSNorm (with and without the residual
add) and KDA's gated norm, under TRITON_INTERPRET=1 on small odd shapes (fp32 to a few ulps, and
bf16), on CUDA at Kimi-Linear-48B's shapes (`gpu`)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.ops.norms import add_rms_norm_torch, gated_rms_norm_torch, rms_norm_torch
from tests.triton_interpreted import interpreted


def _case(rows: int, cols: int, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=gen) * 3
    residual = torch.randn(rows, cols, generator=gen)
    weight = 1 + 0.1 * torch.randn(cols, generator=gen)
    return tuple(t.to(dtype=dtype, device=device) for t in (x, residual, weight))


def _largest_differences(device: str = "cpu") -> list[list[float]]:
    """Per case: the largest |kernel - reference| of the norm, and of the sum and its norm."""
    from splitserve.engine.ops.norms_triton import rms_norm_triton

    found = []
    cases = [
        (1, 96, torch.float32),
        (5, 100, torch.float32),
        (3, 2304, torch.float32),
        (4, 96, torch.bfloat16),
    ]
    for rows, cols, dtype in cases:
        x, residual, weight = _case(rows, cols, dtype, device)
        got, none = rms_norm_triton(x, None, weight, 1e-5)
        assert none is None and got.dtype == dtype
        got_norm, got_sum = rms_norm_triton(x, residual, weight, 1e-5)
        want_norm, want_sum = add_rms_norm_torch(x, residual, weight, 1e-5)
        assert got_sum is not None and got_sum.dtype == want_sum.dtype == dtype
        found.append(
            [
                float((got.float() - rms_norm_torch(x, weight, 1e-5).float()).abs().max()),
                float((got_sum.float() - want_sum.float()).abs().max()),
                float((got_norm.float() - want_norm.float()).abs().max()),
            ]
        )
    # a strided input: the latent columns of an MLA projection (row stride 12, 8 columns)
    wide = _case(3, 12, torch.float32, device)[0]
    weight = _case(1, 8, torch.float32, device)[2]
    got = rms_norm_triton(wide[:, :8], None, weight, 1e-6)[0]
    found.append([float((got - rms_norm_torch(wide[:, :8], weight, 1e-6)).abs().max()), 0.0, 0.0])
    return found


def test_the_rms_norm_kernel_matches_its_reference_under_the_interpreter():
    pytest.importorskip("triton")
    fp32 = [0, 1, 2, 4]
    found = interpreted("tests.engine.test_norm_kernels", "_largest_differences")
    assert all(d <= 1e-5 for i in fp32 for d in found[i]), found  # values up to ~10: a few fp32 ulps
    assert all(d <= 0.07 for d in found[3]), found  # bf16: at most one rounding step apart at |x| < 8


def _gated_case(tokens: int, heads: int, dim: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(tokens * 100 + dim)
    core = torch.randn(tokens, heads, dim, generator=gen)  # KDA's output: fp32
    gate = torch.randn(tokens, heads, dim, generator=gen) * 2
    weight = 1 + 0.1 * torch.randn(dim, generator=gen)
    return core.to(device), gate.to(device), weight.to(device)


def _gated_differences() -> list[float]:
    """Per case: the largest |kernel - reference| of the gated norm (fp32, then fp32 inputs to bf16)."""
    from splitserve.engine.ops.norms_triton import gated_rms_norm_triton

    found = []
    for tokens, heads, dim, dtype in [
        (1, 4, 16, torch.float32),
        (7, 3, 24, torch.float32),
        (5, 2, 128, torch.bfloat16),
    ]:
        core, gate, weight = _gated_case(tokens, heads, dim)
        gate, weight = gate.to(dtype), weight.to(dtype)
        got = gated_rms_norm_triton(core, gate, weight, 1e-5, dtype)
        want = gated_rms_norm_torch(core, gate, weight, 1e-5, dtype)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        found.append(float((got.float() - want.float()).abs().max()))
    return found


def test_the_gated_norm_kernel_matches_its_reference_under_the_interpreter():
    pytest.importorskip("triton")
    found = interpreted("tests.engine.test_norm_kernels", "_gated_differences")
    assert found[0] <= 1e-5 and found[1] <= 1e-5, found
    assert found[2] <= 0.07, found  # bf16 output: one rounding step at |y| < 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_the_gated_norm_kernel_on_cuda_at_real_shapes(tokens):
    from splitserve.engine.ops.norms_triton import gated_rms_norm_triton

    core, gate, weight = _gated_case(tokens, 32, 128, "cuda")
    gate, weight = gate.bfloat16(), weight.bfloat16()
    got = gated_rms_norm_triton(core, gate, weight, 1e-5, torch.bfloat16)
    want = gated_rms_norm_torch(core, gate, weight, 1e-5, torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_the_rms_norm_kernel_on_cuda_at_real_shapes(rows):
    from splitserve.engine.ops.norms_triton import rms_norm_triton

    x, residual, weight = _case(rows, 2304, torch.bfloat16, "cuda")
    got_norm, got_sum = rms_norm_triton(x, residual, weight, 1e-5)
    want_norm, want_sum = add_rms_norm_torch(x, residual, weight, 1e-5)
    assert got_sum is not None and torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got_norm, want_norm, rtol=1.6e-2, atol=1e-2)
