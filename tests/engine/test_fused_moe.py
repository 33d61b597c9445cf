"""The routed-experts paths against a per-token oracle: the torch reference (CPU), the Triton kernel
under TRITON_INTERPRET=1 (CPU, small shapes, in a subprocess so the interpreter is on before triton
is imported), and the kernel on real Kimi-Linear-48B shapes on CUDA (`gpu`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.ops.moe_reference import moe_experts_torch


def per_token_oracle(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


def make_case(
    num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int, *, skewed: bool = False
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(num_tokens * 131 + num_experts)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    scores = torch.randn(num_tokens, num_experts, generator=gen)
    if skewed:  # every token picks experts 0..k-1: one busy expert per choice, the rest idle
        scores[:, :top_k] += 100.0
    weights, expert_ids = scores.sigmoid().topk(top_k, dim=-1)
    return x, w13, w2, weights, expert_ids


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "skewed"),
    [(1, 8, 2, False), (64, 8, 2, False), (300, 16, 4, False), (64, 32, 2, True), (0, 8, 2, False)],
)
def test_torch_reference_matches_per_token_oracle(
    num_tokens: int, num_experts: int, top_k: int, skewed: bool
) -> None:
    """Both the padded-bmm form and (skewed routing) the per-expert loop give the oracle's sums."""
    x, w13, w2, weights, expert_ids = make_case(num_tokens, num_experts, 48, 24, top_k, skewed=skewed)
    got = moe_experts_torch(x, w13, w2, weights, expert_ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    want = per_token_oracle(x, w13, w2, weights, expert_ids).float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _run_interpreted(script: str) -> subprocess.CompletedProcess[str]:
    """Run `script` with TRITON_INTERPRET=1 in a subprocess (the interpreter must be on before triton
    is imported); fails the test if it fails."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


_INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from splitserve.engine.ops.fused_moe import fused_moe
    from splitserve.engine.ops.moe_reference import moe_experts_torch
    from tests.engine.test_fused_moe import make_case

    cases = [(1, 8, 32, 16, 2, False), (5, 4, 40, 24, 2, False), (70, 8, 64, 48, 2, False),
             (40, 4, 32, 16, 3, False), (33, 8, 32, 80, 2, True)]
    for num_tokens, num_experts, hidden, inter, top_k, skewed in cases:
        case = make_case(num_tokens, num_experts, hidden, inter, top_k, skewed=skewed)
        got = fused_moe(*case)
        want = moe_experts_torch(*case)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        print("ok", num_tokens, num_experts, hidden, inter, top_k, skewed)
    """
)


_SHARED_CHECK = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from splitserve.engine.ops.fused_moe import SharedExperts, fused_moe
    from splitserve.engine.ops.moe_reference import moe_experts_torch
    from splitserve.engine.ops.router import with_shared
    from tests.engine.test_fused_moe import make_case

    for num_tokens, num_experts, hidden, inter, top_k, num_shared in [(1, 8, 32, 16, 2, 1), (19, 4, 40, 24, 2, 2)]:
        x, w13, w2, weights, expert_ids = make_case(num_tokens, num_experts, hidden, inter, top_k)
        gen = torch.Generator().manual_seed(num_tokens)
        gate_up = torch.randn(2 * num_shared * inter, hidden, generator=gen) / hidden**0.5
        down = torch.randn(hidden, num_shared * inter, generator=gen) / inter**0.5
        gate, up = gate_up.chunk(2)
        want = moe_experts_torch(x, w13, w2, weights, expert_ids) + F.linear(F.silu(x @ gate.T) * (x @ up.T), down)
        both = with_shared(weights, expert_ids, num_experts, num_shared)
        got = fused_moe(x, w13, w2, *both, SharedExperts(gate_up, down, num_shared))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        print("ok", num_tokens, num_shared)
    """
)


def test_shared_experts_ride_in_the_routed_kernels_under_the_interpreter() -> None:
    """The shared MLP as one or two extra experts (its intermediate slices) gives the routed sum plus the MLP."""
    pytest.importorskip("triton")
    proc = _run_interpreted(_SHARED_CHECK)
    assert proc.stdout.count("ok") == 2, proc.stdout


def test_triton_kernel_under_the_interpreter_matches_the_reference() -> None:
    """Odd sizes (not multiples of the tiles), one token, top-3, and every token on the same experts."""
    pytest.importorskip("triton")
    proc = _run_interpreted(_INTERPRETER_CHECK)
    assert proc.stdout.count("ok") == 5, proc.stdout


_ALIGN_CHECK = textwrap.dedent(
    """
    import torch
    from splitserve.engine.ops.fused_moe import align_by_expert, align_by_expert_triton

    gen = torch.Generator().manual_seed(0)
    cases = [(1, 8, 2, 16), (5, 4, 2, 16), (70, 8, 2, 16), (40, 4, 3, 64), (33, 8, 2, 16),
             (300, 16, 4, 64), (64, 256, 8, 16), (7, 3, 2, 16), (1000, 16, 2, 64)]
    for num_tokens, num_experts, top_k, block_m in cases:
        scores = torch.randn(num_tokens, num_experts, generator=gen)
        if num_tokens == 33:  # every token on the same experts: one long run, the others empty
            scores[:, :top_k] += 100.0
        expert_ids = scores.topk(top_k, dim=-1)[1]
        want = align_by_expert(expert_ids, num_experts, block_m)
        got = align_by_expert_triton(expert_ids, num_experts, block_m)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), (num_tokens, num_experts, top_k, block_m, g, w)
        print("ok", num_tokens, num_experts, top_k, block_m)
    """
)


def test_alignment_kernel_under_the_interpreter_equals_the_torch_alignment() -> None:
    """Exactly the same sorted pairs and block experts: odd counts, empty experts, 256 experts, top-8."""
    pytest.importorskip("triton")
    proc = _run_interpreted(_ALIGN_CHECK)
    assert proc.stdout.count("ok") == 9, proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 256, 8), (64, 256, 8), (64, 16, 2)])
def test_alignment_kernel_on_cuda_equals_the_torch_alignment(
    num_tokens: int, num_experts: int, top_k: int
) -> None:
    from splitserve.engine.ops.fused_moe import align_by_expert, align_by_expert_triton

    scores = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_tokens))
    expert_ids = scores.topk(top_k, dim=-1)[1].cuda()
    for block_m in (16, 64):
        for got, want in zip(
            align_by_expert_triton(expert_ids, num_experts, block_m),
            align_by_expert(expert_ids, num_experts, block_m),
        ):
            assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_triton_kernel_on_real_shapes_matches_the_reference(num_tokens: int) -> None:
    """Kimi-Linear-48B's expert shapes (256 experts, top-8, H 2304, I 1024) in bf16."""
    from splitserve.engine.ops.fused_moe import fused_moe

    x, w13, w2, weights, expert_ids = (t.cuda() for t in make_case(num_tokens, 256, 2304, 1024, 8))
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    got = fused_moe(x, w13, w2, weights, expert_ids).float()
    want = moe_experts_torch(x.float(), w13.float(), w2.float(), weights, expert_ids)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_shared_expert_in_the_kernels_on_real_shapes(num_tokens: int) -> None:
    """Kimi-Linear-48B's experts plus its one shared expert, in bf16, against routed + shared MLP in fp32."""
    from splitserve.engine.ops.fused_moe import SharedExperts, fused_moe
    from splitserve.engine.ops.router import with_shared

    x, w13, w2, weights, expert_ids = (t.cuda() for t in make_case(num_tokens, 256, 2304, 1024, 8))
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(2048, 2304, generator=gen) / 2304**0.5).cuda()
    down = (torch.randn(2304, 1024, generator=gen) / 1024**0.5).cuda()
    gate, up = gate_up.chunk(2)
    want = moe_experts_torch(x, w13, w2, weights, expert_ids) + F.linear(
        F.silu(x @ gate.T) * (x @ up.T), down
    )
    shared = SharedExperts(gate_up.bfloat16(), down.bfloat16(), 1)
    both = with_shared(weights, expert_ids, 256, 1)
    got = fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), *both, shared).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
