"""The CUDA code paths of the engine on the CPU, their kernels stubbed: the torch code around each
Triton launch (paged MLA, fused MoE) runs, the launch does nothing. Tests that check what that torch
code does (no host sync, shapes that do not depend on data) use these under FakeTensorMode."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from splitserve.engine.model import moe
from splitserve.engine.ops import fused_moe, paged_mla


class NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


def stub_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paged MLA and the routed experts take their Triton paths, with every launch stubbed."""
    from splitserve.engine.ops import paged_mla_triton

    monkeypatch.setattr(paged_mla, "mla_backend", lambda device: "triton")
    monkeypatch.setattr(paged_mla_triton, "_kernel", lambda: NoLaunch())
    monkeypatch.setattr(fused_moe, "_launch", lambda *args, **kwargs: None)
    monkeypatch.setattr(fused_moe, "_align_kernel", lambda: NoLaunch())

    def experts_fused(
        self: moe.Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        return fused_moe.fused_moe(x, self.w13, self.w2, weights, ids)

    monkeypatch.setattr(moe.Experts, "forward", experts_fused)
