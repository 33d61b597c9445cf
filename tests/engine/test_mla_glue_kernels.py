"""MLA's decode glue on the Triton path against the torch path: the KV write (latent norm, rope part,
scatter into the pool) and the attention with the query's parts read apart and the output written
head-major (as the layer's CUDA path lays them out). Under TRITON_INTERPRET=1 on small shapes (fp32
to 1e-6), and at Kimi-Linear-48B's shapes on CUDA (`gpu`)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.ops.paged_mla import paged_mla_torch, write_kv_torch
from tests.engine.test_paged_mla import make_case
from tests.triton_interpreted import interpreted


def write_case(
    tokens: int, rank: int, rope: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(tokens + rank)
    kv = torch.randn(tokens, rank + rope, generator=gen) * 2
    weight = 1 + 0.1 * torch.randn(rank, generator=gen)
    pool = torch.randn(3 * tokens + 5, rank + rope, generator=gen)
    slots = torch.randperm(3 * tokens + 5, generator=gen)[:tokens]
    return kv.to(device, dtype), weight.to(device, dtype), pool.to(device, dtype), slots.to(device)


def write_differences() -> list[float]:
    """Per case: the largest |kernel - reference| over the whole pool after the write."""
    from splitserve.engine.ops.paged_mla_triton import write_kv_triton

    found = []
    for tokens, rank, rope, dtype in [
        (1, 16, 8, torch.float32),
        (7, 24, 5, torch.float32),
        (4, 32, 16, torch.bfloat16),
    ]:
        kv, weight, pool, slots = write_case(tokens, rank, rope, dtype)
        want = pool.clone()
        write_kv_torch(kv, weight, 1e-6, want, slots)
        write_kv_triton(kv, weight, 1e-6, pool, slots)
        found.append(float((pool.float() - want.float()).abs().max()))
    return found


def split_differences() -> list[float]:
    """Per case (decode rows, a ragged prefill group): the largest |kernel - reference| of the output,
    the query's latent part a head-major product as the layer makes it, the output written head-major."""
    from splitserve.engine.ops.paged_mla_triton import paged_mla_triton_split

    found = []
    for computed, lengths in [([5, 40, 0], [1, 1, 1]), ([3, 0], [6, 2])]:
        heads, rank, rope = 3, 16, 8
        q, pool, group = make_case(computed, lengths, heads, rank, rope, seed=4)
        want = torch.zeros(q.shape[0], heads, rank)
        paged_mla_torch(q, pool, group, rank, 0.2, want)
        q_latent = q[..., :rank].transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, rank], head-major
        got = torch.zeros(heads, q.shape[0], rank).transpose(0, 1)
        paged_mla_triton_split(q_latent, q[..., rank:], pool, group, 0.2, got, num_splits=2)
        found.append(float((got - want).abs().max()))
    return found


def test_the_kv_write_kernel_matches_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    found = interpreted("tests.engine.test_mla_glue_kernels", "write_differences")
    assert found[0] <= 1e-6 and found[1] <= 1e-6, found
    assert found[2] <= 0.07, found  # bf16: one rounding step at |x| < 8


def test_attention_with_the_query_parts_apart_matches_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    assert all(d <= 1e-5 for d in interpreted("tests.engine.test_mla_glue_kernels", "split_differences"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_the_kv_write_kernel_on_cuda_at_real_shapes(tokens):
    from splitserve.engine.ops.paged_mla_triton import write_kv_triton

    kv, weight, pool, slots = write_case(tokens, 512, 64, torch.bfloat16, "cuda")
    want = pool.clone()
    write_kv_torch(kv, weight, 1e-6, want, slots)
    write_kv_triton(kv, weight, 1e-6, pool, slots)
    torch.testing.assert_close(pool.float(), want.float(), rtol=1.6e-2, atol=1e-2)
