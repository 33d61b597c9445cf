"""The CUDA code paths of the engine on the CPU, their kernels stubbed: every kernel backend takes its
CUDA choice (paged MLA, fused MoE and the fused glue kernels in Triton) and every Triton launch does
nothing; the torch code around each launch runs. Tests that check what that torch code does (no host
sync, shapes that do not depend on data) use these under FakeTensorMode."""

from __future__ import annotations

from typing import Any

import pytest

from splitserve.engine.ops import fused_moe, paged_mla, triton_kernel


class NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


def stub_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Triton backend chosen, as on a CUDA device, with every launch stubbed."""
    for env in (paged_mla.BACKEND_ENV, fused_moe.BACKEND_ENV, triton_kernel.FUSED_BACKEND_ENV):
        monkeypatch.setenv(env, "triton")
    monkeypatch.setattr(triton_kernel, "_stand_in", lambda kernel: NoLaunch())
