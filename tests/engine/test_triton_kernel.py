"""The rules every engine Triton kernel follows (ops/triton_kernel.py): a kernel that fails is logged
once and its torch reference runs from then on; a stand-in takes every launch while it is active;
the fused glue kernels run on CUDA only unless forced."""

from __future__ import annotations

import logging

import pytest
import torch

from splitserve.engine.ops import triton_kernel
from tests.triton_interpreted import interpreted

try:
    import triton.language as tl
except ImportError:  # the interpreter test skips; the others need no triton
    tl = None


def _broken_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + undefined_name)  # type: ignore[name-defined]  # noqa: F821


def broken_kernel_falls_back() -> list[float]:
    """Under the interpreter: a kernel that cannot run, launched twice through `kernel_or_torch`."""
    kernel = triton_kernel.TritonKernel("broken", _broken_kernel)
    x = torch.zeros(4)

    def launch() -> torch.Tensor:
        kernel[(1,)](x, BLOCK=4)
        return x

    out = [triton_kernel.kernel_or_torch("broken", launch, lambda: torch.full((4,), 7.0)) for _ in range(2)]
    return [float(o.sum()) for o in out] + [float("broken" in triton_kernel._failed)]


def test_a_kernel_that_fails_to_build_falls_back_to_torch_under_the_interpreter():
    pytest.importorskip("triton")
    assert interpreted("tests.engine.test_triton_kernel", "broken_kernel_falls_back") == [28.0, 28.0, 1.0]


def test_a_failed_kernel_is_logged_once_and_not_tried_again(monkeypatch, caplog):
    monkeypatch.setattr(triton_kernel, "_failed", set())
    calls = []

    def kernel_call() -> str:
        calls.append(1)
        raise RuntimeError("no such intrinsic")

    with caplog.at_level(logging.ERROR, logger=triton_kernel.__name__):
        results = [triton_kernel.kernel_or_torch("k", kernel_call, lambda: "torch") for _ in range(3)]
    assert results == ["torch"] * 3
    assert len(calls) == 1
    assert len([r for r in caplog.records if "k Triton kernel failed" in r.getMessage()]) == 1


def test_a_stand_in_takes_every_launch_while_active():
    launched: list[tuple[str, object, tuple[object, ...]]] = []

    class Recorder:
        def __init__(self, kernel: triton_kernel.TritonKernel) -> None:
            self.name = kernel.name

        def __getitem__(self, grid: object) -> object:
            return lambda *args, **kwargs: launched.append((self.name, grid, args))

    kernel = triton_kernel.TritonKernel("k", lambda x: None)
    with triton_kernel.stand_in(Recorder):
        kernel[(3,)](1)
    assert launched == [("k", (3,), (1,))]
    assert triton_kernel._stand_in is None


def test_the_fused_kernels_run_on_cuda_only_unless_forced(monkeypatch):
    monkeypatch.delenv(triton_kernel.FUSED_BACKEND_ENV, raising=False)
    assert triton_kernel.fused_backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv(triton_kernel.FUSED_BACKEND_ENV, "triton")
    if triton_kernel.importable("triton"):
        assert triton_kernel.fused_backend(torch.device("cpu")) == "triton"
    monkeypatch.setenv(triton_kernel.FUSED_BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="expected 'torch' or 'triton'"):
        triton_kernel.fused_backend(torch.device("cpu"))


def test_a_moe_layer_whose_kernels_fail_gives_the_torch_result(monkeypatch, caplog):
    """Every Triton launch raising (a kernel that does not build): the MoE block's fused path (the
    shared experts riding in the routed kernels) falls back to the reference, same output."""
    from splitserve.engine.model.moe import SparseMoE
    from splitserve.engine.ops import fused_moe
    from tests.engine.test_decode_launches import decode_launches

    config = decode_launches.model_config("tiny")
    torch.manual_seed(0)
    moe = SparseMoE(config)
    for p in moe.parameters():
        p.requires_grad_(False).normal_(0, 0.2)
    moe.shared_experts.finalize()
    x = torch.randn(5, config.hidden_size)
    want = moe(x)  # the CPU: torch references

    class Broken:
        def __getitem__(self, grid: object) -> object:
            raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(triton_kernel, "_failed", set())
    monkeypatch.setenv(fused_moe.BACKEND_ENV, "triton")
    with triton_kernel.stand_in(lambda kernel: Broken()), caplog.at_level(logging.ERROR):
        got = [moe(x) for _ in range(2)]
    assert all(torch.equal(g, want) for g in got)
    assert triton_kernel._failed == {"moe_align", "moe_grouped_gemm"}
    assert len([r for r in caplog.records if "Triton kernel failed" in r.getMessage()]) == 2  # once each
