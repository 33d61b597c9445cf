"""KDA's decode-step gates kernel (conv window, L2 norms, forget gate, beta in one launch) against the
torch reference: under TRITON_INTERPRET=1 on small shapes (fp32 to 1e-6, the moved conv windows
exactly; bf16), and on CUDA at Kimi-Linear-48B's head shapes (`gpu`)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.ops.kda_gates import conv_step_torch, kda_gates_torch
from tests.triton_interpreted import interpreted


def make_case(
    rows: int, heads: int, head_dim: int, taps: int, dtype: torch.dtype, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """One layer's decode inputs as the layer slices them from its projection, on scattered slots."""
    gen = torch.Generator().manual_seed(rows * 10 + head_dim)
    dim = heads * head_dim
    proj = torch.randn(rows, 4 * dim + heads + 3, generator=gen)  # wider rows: strided views, as in the layer
    proj[:, 3 * dim : 3 * dim + 2] = torch.tensor([25.0, -30.0])  # softplus past its threshold, and tiny
    case = {
        "mixed": proj[:, : 3 * dim],
        "f": proj[:, 3 * dim : 4 * dim],
        "b_logit": proj[:, 4 * dim : 4 * dim + heads],
        "conv_state": torch.randn(rows + 3, 3 * dim, taps - 1, generator=gen),
        "conv_weight": torch.randn(3 * dim, taps, generator=gen) / taps**0.5,
        "slots": torch.randperm(rows + 3, generator=gen)[:rows],
        "dt_bias": torch.randn(dim, generator=gen),
        "decay_rate": torch.rand(heads, 1, generator=gen) * 4,
    }
    return {
        name: t.to(
            device=device,
            dtype=dtype if name in ("mixed", "f", "b_logit", "conv_state", "conv_weight") else None,
        )
        for name, t in case.items()
    }


def run_both(case: dict[str, torch.Tensor], heads: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(kernel, reference): q, k, v, g, beta, then the conv state after the step."""
    from splitserve.engine.ops.kda_gates_triton import kda_decode_gates_triton

    ref_state = case["conv_state"].clone()
    conv_out = conv_step_torch(case["mixed"], ref_state, case["slots"], case["conv_weight"])
    want = kda_gates_torch(conv_out, case["f"], case["b_logit"], case["dt_bias"], case["decay_rate"], heads)
    got = kda_decode_gates_triton(**case, num_heads=heads)
    return [*got, case["conv_state"]], [*want, ref_state]


def largest_differences() -> list[list[float]]:
    """Per case: the largest |kernel - reference| / (1 + |reference|) of q, k, v, g, beta and the conv state."""
    found = []
    for rows, heads, head_dim, taps, dtype in [
        (1, 2, 16, 4, torch.float32),
        (5, 3, 24, 4, torch.float32),
        (4, 2, 32, 3, torch.float32),
        (3, 2, 32, 4, torch.bfloat16),
    ]:
        got, want = run_both(make_case(rows, heads, head_dim, taps, dtype), heads)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous(), (g.shape, w.shape)
        found.append(
            [float(((g.float() - w.float()).abs() / (1 + w.float().abs())).max()) for g, w in zip(got, want)]
        )
    return found


def test_the_decode_gates_kernel_matches_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    found = interpreted("tests.engine.test_kda_gates", "largest_differences")
    for case in found[:3]:  # fp32: the same values up to the order of a few-term sum (relative 1e-6)
        assert all(d <= 1e-6 for d in case[:5]), found
        assert case[5] == 0.0, found  # the moved window is a copy
    assert all(d <= 0.02 for d in found[3]), found  # bf16: a rounding step or two of the conv's taps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 64])
def test_the_decode_gates_kernel_on_cuda_at_real_shapes(rows):
    got, want = run_both(make_case(rows, 32, 128, 4, torch.bfloat16, "cuda"), 32)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)  # bf16 rounding of the taps
    assert torch.equal(got[-1], want[-1])
