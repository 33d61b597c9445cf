"""The ReplaySSM Triton kernel, run under TRITON_INTERPRET=1 on the CPU, against the torch ring path:
outputs, the stored record and the folded checkpoint, over rows at different points of their windows
(a fold included), and the backend choice."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.ops.backend import importable
from splitserve.engine.ops.replay_ssm import BACKEND_ENV, replay_backend
from tests.triton_interpreted import interpreted

needs_triton = pytest.mark.skipif(not importable("triton"), reason="triton is not installed")
# (heads, dk, dv, window, block_v): a value dim split over programs, and dims that are not powers of 2
CASES = [(2, 8, 8, 4, 32), (3, 12, 20, 5, 8), (1, 16, 16, 1, 16)]


def interpreted_errors() -> dict[str, float]:
    """Run with TRITON_INTERPRET=1 (in a subprocess: triton picks interpreter or compiler when
    imported): the kernel's largest error against the torch path per case and tensor, over steps."""
    from splitserve.engine.ops.kda import l2norm
    from splitserve.engine.ops.replay_ssm_triton import replay_step_triton
    from splitserve.engine.replay_ring import ReplayRing

    errors: dict[str, float] = {}
    for case_id, (heads, dk, dv, window, block_v) in enumerate(CASES):
        gen = torch.Generator().manual_seed(case_id)
        num_slots, slots = 5, [4, 0, 2]
        pool = torch.randn(num_slots, heads, dk, dv, generator=gen)
        reference = ReplayRing.allocate({0: pool.clone()}, window, "cpu").layers[0]
        kernel = ReplayRing.allocate({0: pool.clone()}, window, "cpu").layers[0]
        worst = {"out": 0.0, "checkpoint": 0.0, "ring": 0.0}
        for t in range(2 * window + 3):
            active = [s for i, s in enumerate(slots) if t >= i]  # rows join late: counts differ
            n = len(active)
            q = l2norm(torch.randn(n, heads, dk, generator=gen)) * dk**-0.5
            k = l2norm(torch.randn(n, heads, dk, generator=gen))
            v = torch.randn(n, heads, dv, generator=gen)
            g = -torch.rand(n, heads, dk, generator=gen)
            beta = torch.rand(n, heads, generator=gen)
            index = torch.tensor(active)
            expected = reference.step(q, k, v, g, beta, index, torch.tensor(reference.counts)[index], active)
            count = torch.tensor([kernel.counts[s] for s in active])
            got = replay_step_triton(
                q, k, v, g, beta, kernel.checkpoint, kernel.k, kernel.u, kernel.g, index, count, block_v
            )
            kernel.advance(active)
            assert kernel.counts == reference.counts
            worst["out"] = max(worst["out"], float((got - expected).abs().max()))
            worst["checkpoint"] = max(
                worst["checkpoint"], float((kernel.checkpoint - reference.checkpoint).abs().max())
            )
            for s in active:
                held = reference.counts[s] or window  # after a fold the whole window is still in the ring
                for ours, theirs in (
                    (kernel.k, reference.k),
                    (kernel.u, reference.u),
                    (kernel.g, reference.g),
                ):
                    worst["ring"] = max(worst["ring"], float((ours[s, :held] - theirs[s, :held]).abs().max()))
        errors.update({f"{case_id}-{name}": value for name, value in worst.items()})
    return errors


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, float]:
    return interpreted("tests.engine.test_replay_triton", "interpreted_errors")


@needs_triton
@pytest.mark.parametrize("what", ["out", "checkpoint", "ring"])
@pytest.mark.parametrize("case_id", range(len(CASES)))
def test_triton_kernel_interpreted_matches_torch(interpreter_results, case_id, what):
    assert interpreter_results[f"{case_id}-{what}"] < 1e-5


def test_backend_is_torch_on_cpu_and_env_overrides(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert replay_backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert replay_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "bogus")
    with pytest.raises(ValueError, match="expected 'torch' or 'triton'"):
        replay_backend(torch.device("cpu"))
