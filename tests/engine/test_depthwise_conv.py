"""KDA's short convolution on the CPU (`depthwise_conv`, a sum of shifted taps) against torch's
grouped `conv1d`: within 1e-6 in fp32 (the same bits where measured), within one rounding in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.model.kda import depthwise_conv


@pytest.mark.parametrize(("batch", "channels", "taps", "length"), [(1, 8, 4, 1), (3, 192, 4, 257), (2, 5, 2, 9)])
def test_equals_grouped_conv1d_in_fp32(batch, channels, taps, length):
    gen = torch.Generator().manual_seed(channels + length)
    seq = torch.randn(batch, channels, taps - 1 + length, generator=gen)
    weight = torch.randn(channels, taps, generator=gen)
    expected = F.conv1d(seq, weight.unsqueeze(1), groups=channels)
    got = depthwise_conv(seq, weight)
    assert got.shape == expected.shape == (batch, channels, length)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_bf16_stays_within_one_rounding_of_the_exact_sum():
    gen = torch.Generator().manual_seed(0)
    seq = torch.randn(2, 64, 3 + 100, generator=gen).bfloat16()
    weight = torch.randn(64, 4, generator=gen).bfloat16()
    exact = F.conv1d(seq.double(), weight.double().unsqueeze(1), groups=64)
    got = depthwise_conv(seq, weight)
    assert got.dtype == torch.bfloat16
    # one rounding of the exact sum: within half a bf16 ulp (2^-8 relative), not four roundings' worth
    assert torch.allclose(got.double(), exact, rtol=2**-8, atol=1e-6)
