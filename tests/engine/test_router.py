"""The MoE router kernel (fp32 logits, sigmoid, bias, group top-k, top-k, renormalised weights in one
launch) against the torch reference: under TRITON_INTERPRET=1 the same experts (as sets per token)
with weights within 1e-6 in fp32, grouped and ungrouped; on CUDA at real shapes (`gpu`)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.ops.router import RouterSpec, route_torch
from tests.triton_interpreted import interpreted

CASES = [  # tokens, hidden, spec
    (1, 40, RouterSpec(8, 2, 2, 1, True, 2.5)),  # the tiny preset's routing
    (37, 64, RouterSpec(16, 2, 2, 1, True, 2.446)),  # the 1B shape's, more tokens than a block
    (5, 48, RouterSpec(32, 4, 4, 2, False, 1.0)),  # two of four groups, no renormalisation
    (20, 33, RouterSpec(12, 3, 1, 1, True, 1.0)),  # ungrouped (Kimi-Linear-48B), odd sizes
]


def make_case(tokens: int, hidden: int, spec: RouterSpec, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(tokens * 7 + spec.num_experts)
    x = torch.randn(tokens, hidden + 5, generator=gen)[
        :, :hidden
    ]  # a strided view, as norms' outputs are not
    weight = torch.randn(spec.num_experts, hidden, generator=gen) / hidden**0.5
    bias = (torch.rand(spec.num_experts, generator=gen) - 0.5) * 0.2
    return x.to(device), weight.to(device), bias.to(device)


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's choices in expert order (the reference's `topk` is unsorted)."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def compared() -> list[list[float]]:
    """Per case: whether the kernel chose the reference's experts (1.0), and the largest weight difference."""
    from splitserve.engine.ops.router_triton import route_triton

    found = []
    for tokens, hidden, spec in CASES:
        case = make_case(tokens, hidden, spec)
        got_w, got_ids = by_expert(*route_triton(*case, spec))
        want_w, want_ids = by_expert(*route_torch(*case, spec))
        assert got_ids.dtype == want_ids.dtype == torch.int64 and got_w.dtype == torch.float32
        found.append([float(torch.equal(got_ids, want_ids)), float((got_w - want_w).abs().max())])
    return found


def shared_appended() -> list[list[float]]:
    """The kernel's and the reference's choices with two shared experts appended, for the 1B case."""
    from splitserve.engine.ops.router import route
    from splitserve.engine.ops.router_triton import route_triton

    tokens, hidden, spec = CASES[1]
    case = make_case(tokens, hidden, spec)
    got_w, got_ids = route_triton(*case, spec, num_shared=2)
    want_w, want_ids = route(*case, spec, num_shared=2)  # the torch backend: the reference
    return [got_ids[:, 2:].tolist()[0], got_w[:, 2:].tolist()[0], want_ids[:, 2:].tolist()[0]]


def test_the_router_kernel_appends_the_shared_experts_under_the_interpreter():
    pytest.importorskip("triton")
    ids, weights, reference_ids = interpreted("tests.engine.test_router", "shared_appended")
    assert ids == reference_ids == [16, 17] and weights == [1.0, 1.0]


def test_the_router_kernel_matches_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    found = interpreted("tests.engine.test_router", "compared")
    assert all(same == 1.0 and diff <= 1e-6 for same, diff in found), found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 64, 2048])
@pytest.mark.parametrize(
    "spec", [RouterSpec(256, 8, 1, 1, True, 2.446), RouterSpec(16, 2, 2, 1, True, 2.446)]
)
def test_the_router_kernel_on_cuda_at_real_shapes(tokens, spec):
    from splitserve.engine.ops.router_triton import route_triton

    x, weight, bias = make_case(tokens, 2304, spec, "cuda")
    x = x.bfloat16()
    got_w, got_ids = by_expert(*route_triton(x, weight, bias, spec))
    want_w, want_ids = by_expert(*route_torch(x, weight, bias, spec))
    assert (got_ids == want_ids).all(dim=-1).float().mean() >= 0.99  # near-ties may rank differently
    same = (got_ids == want_ids).all(dim=-1)
    torch.testing.assert_close(got_w[same], want_w[same], rtol=1e-5, atol=1e-6)
