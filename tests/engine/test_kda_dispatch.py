"""KDA backend choice: the torch reference on the CPU, fla's kernels on CUDA (gpu-marked, against torch)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import llm_engine
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.ops import kda_dispatch
from splitserve.engine.ops.kda import kda_chunked, kda_recurrent_step, l2norm
from splitserve.engine.ops.kda_dispatch import (
    BACKEND_ENV,
    kda_backend,
    kda_decode,
    kda_decode_into,
    kda_prefill,
)
from splitserve.engine_config import EngineConfig


def random_inputs(
    batch: int, heads: int, length: int, dim: int, device: str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Inputs as the layer makes them: [B, H, L, D] fp32, q/k normalised, g <= 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q = l2norm(randn(batch, heads, length, dim)) * dim**-0.5
    k = l2norm(randn(batch, heads, length, dim))
    v = randn(batch, heads, length, dim)
    g = -torch.nn.functional.softplus(randn(batch, heads, length, dim)) * 0.1
    beta = torch.sigmoid(randn(batch, heads, length))
    state = randn(batch, heads, dim, dim) * 0.1
    return tuple(t.to(device) for t in (q, k, v, g, beta, state))


def test_cpu_picks_the_torch_path(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert kda_backend(torch.device("cpu")) == "torch"
    q, k, v, g, beta, state = random_inputs(2, 3, 21, 8)
    out, final = kda_prefill(q, k, v, g, beta, state)
    ref_out, ref_final = kda_chunked(q, k, v, g, beta, state)
    assert torch.equal(out, ref_out) and torch.equal(final, ref_final)
    step = [t[:, :, 0] for t in (q, k, v, g, beta)]
    out, final = kda_decode(*step, state)
    ref_out, ref_final = kda_recurrent_step(*step, state)
    assert torch.equal(out, ref_out) and torch.equal(final, ref_final)


def decode_into_both(device: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, ...]:
    """kda_decode_into on a pool of 7 slots, rows in slots 5, 0, 3; returns (output, pool after)."""
    q, k, v, g, beta, _ = random_inputs(
        3, 2 if device == "cpu" else 32, 1, 8 if device == "cpu" else 128, device
    )
    pool = random_inputs(7, q.shape[1], 1, q.shape[-1], device, seed=3)[-1]
    slots = torch.tensor([5, 0, 3], device=device)
    monkeypatch.setenv(BACKEND_ENV, backend)
    step = [t[:, :, 0] for t in (q, k, v, g, beta)]
    expected_out, expected_state = kda_recurrent_step(*step, pool[slots])
    out = kda_decode_into(*step, pool, slots)
    return out, pool, expected_out, expected_state, slots


def test_decode_into_updates_only_the_rows_slots(monkeypatch):
    before = random_inputs(7, 2, 1, 8, seed=3)[-1]
    out, pool, expected_out, expected_state, slots = decode_into_both("cpu", "torch", monkeypatch)
    assert torch.equal(out, expected_out) and torch.equal(pool[slots], expected_state)
    untouched = [1, 2, 4, 6]
    assert torch.equal(pool[untouched], before[untouched])


def test_cuda_picks_fla_when_installed_and_refuses_without_it(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(kda_dispatch, "fla_available", lambda: True)
    assert kda_backend(torch.device("cuda")) == "fla"
    assert kda_backend(torch.device("cpu")) == "torch"
    monkeypatch.setattr(kda_dispatch, "fla_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"pip install 'splitserve\[gpu\]'.*SPLITSERVE_KDA_BACKEND=torch"):
        kda_backend(torch.device("cuda:0"))
    assert kda_backend(torch.device("cpu")) == "torch"  # the CPU needs no fla
    monkeypatch.setenv(BACKEND_ENV, "torch")  # told to take the torch path: it does
    assert kda_backend(torch.device("cuda")) == "torch"


def test_an_engine_on_cuda_without_fla_refuses_to_load(monkeypatch, tiny_model_path):
    """At load, before any weight is read (this CPU build could not put them on CUDA anyway)."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(kda_dispatch, "fla_available", lambda: False)
    loaded = []
    monkeypatch.setattr(llm_engine, "load_model", lambda *args: loaded.append(args))
    with pytest.raises(RuntimeError, match=r"needs flash-linear-attention.*splitserve\[gpu\]"):
        LLMEngine(EngineConfig(model=str(tiny_model_path), device="cuda", max_model_len=128))
    assert loaded == []


def test_env_overrides_and_says_what_is_wrong(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    monkeypatch.setattr(kda_dispatch, "fla_available", lambda: True)
    assert kda_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "fla")
    monkeypatch.setattr(kda_dispatch, "fla_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"pip install 'splitserve\[gpu\]'"):
        kda_backend(torch.device("cuda"))
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="expected 'torch' or 'fla'"):
        kda_backend(torch.device("cuda"))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_fla = pytest.mark.skipif(
    not kda_dispatch.fla_available(), reason="needs fla-core: pip install 'splitserve[gpu]'"
)


@pytest.mark.gpu
@needs_cuda
@needs_fla
@pytest.mark.parametrize("length", [1, 64, 1000])
def test_fla_prefill_matches_torch_on_cuda(monkeypatch, length):
    """Kimi-Linear-48B's KDA: 32 heads of 128; the final state is fp32 and equals the reference's."""
    q, k, v, g, beta, state = random_inputs(2, 32, length, 128, "cuda")
    monkeypatch.setenv(BACKEND_ENV, "torch")
    ref_out, ref_final = kda_prefill(q, k, v, g, beta, state)
    monkeypatch.setenv(BACKEND_ENV, "fla")
    out, final = kda_prefill(q, k, v, g, beta, state)
    assert final.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(final, ref_final, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@needs_cuda
@needs_fla
def test_fla_decode_matches_torch_on_cuda(monkeypatch):
    q, k, v, g, beta, state = random_inputs(64, 32, 1, 128, "cuda", seed=1)
    step = [t[:, :, 0] for t in (q, k, v, g, beta)]
    monkeypatch.setenv(BACKEND_ENV, "torch")
    ref_out, ref_final = kda_decode(*step, state)
    monkeypatch.setenv(BACKEND_ENV, "fla")
    out, final = kda_decode(*step, state)
    assert final.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(final, ref_final, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@needs_cuda
@needs_fla
def test_fla_decode_into_the_pool_matches_torch_on_cuda(monkeypatch):
    out, pool, expected_out, expected_state, slots = decode_into_both("cuda", "fla", monkeypatch)
    torch.testing.assert_close(out.float(), expected_out, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(pool[slots], expected_state, rtol=2e-2, atol=2e-3)
