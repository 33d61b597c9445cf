"""The decode kernels' warm-up (engine/model/warm_up.py): it launches every Triton kernel a decode step
launches, per batch size, with valid arguments (run under the interpreter), and nothing on the CPU path."""

from __future__ import annotations

import os
import tempfile

import pytest

from splitserve.engine.model.warm_up import warm_up_decode_kernels
from splitserve.engine.ops import triton_kernel
from tests.engine.kernel_stubs import stub_triton_kernels
from tests.triton_interpreted import interpreted

pytest.importorskip("triton")

from experiments import decode_launches  # noqa: E402


def test_nothing_is_launched_where_the_torch_references_run(tiny_llm, monkeypatch):
    for env in ("SPLITSERVE_MLA_BACKEND", "SPLITSERVE_MOE_BACKEND", triton_kernel.FUSED_BACKEND_ENV):
        monkeypatch.delenv(env, raising=False)
    assert warm_up_decode_kernels(tiny_llm.engine.model, [1, 4]) == []


def test_the_warm_up_launches_every_kernel_of_a_decode_step(tiny_llm, monkeypatch):
    step = decode_launches.count_decode_step(decode_launches.model_config("tiny"), batch_size=3, context=20)
    in_a_step = {launch.kernel.name for launch in step.launched}
    stub_triton_kernels(monkeypatch)
    launched: list[str] = []

    class Recorder:
        def __init__(self, kernel: triton_kernel.TritonKernel) -> None:
            self.name = kernel.name

        def __getitem__(self, grid: object) -> object:
            return lambda *args, **kwargs: launched.append(self.name)

    with triton_kernel.stand_in(Recorder):
        warmed = warm_up_decode_kernels(tiny_llm.engine.model, [1, 4])
    assert len(warmed) == 2 * 5  # norms, KDA gates, router, MLA, MoE; per batch size
    assert in_a_step <= set(launched), in_a_step - set(launched)


def warm_up_interpreted() -> list[str]:
    """Under the interpreter: the tiny model's warm-up, every kernel launched for real on zeros."""
    from splitserve import LLM
    from splitserve.tiny_model import make_tiny_model

    os.environ.update(dict.fromkeys(("SPLITSERVE_MLA_BACKEND", "SPLITSERVE_MOE_BACKEND"), "triton"))
    os.environ[triton_kernel.FUSED_BACKEND_ENV] = "triton"
    with tempfile.TemporaryDirectory() as where:
        llm = LLM(model=str(make_tiny_model(where, seed=0)), dtype="float32", max_model_len=64)
        return warm_up_decode_kernels(llm.engine.model, [1, 3])


def test_the_warm_up_runs_its_kernels_under_the_interpreter():
    warmed = interpreted("tests.engine.test_warm_up", "warm_up_interpreted")
    assert warmed == ["norms", "kda_decode_gates", "moe_router", "paged_mla", "fused_moe"] * 2  # none raised
