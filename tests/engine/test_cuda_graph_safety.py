"""The forward a decode CUDA graph records has no host sync and no shape that depends on data, checked on
the CPU: under FakeTensorMode any `.item()`, `.tolist()`, `nonzero` or boolean-mask index raises. The
Triton launches (paged MLA, fused MoE) are stubbed; the torch code around them runs. The torch
references, which graphs refuse, are shown to fail the same check."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from splitserve import LLM, SamplingParams
from splitserve.engine.cuda_graph import DecodeGraphs
from splitserve.engine.ops import replay_ssm, triton_kernel
from splitserve.engine.ops.triton_kernel import TritonKernel
from splitserve.engine.request import Request
from tests.engine.kernel_stubs import stub_triton_kernels

pytest.importorskip("triton")  # the kernels' Python wrappers import it


def _requests() -> list[Request]:
    """Three decode rows: slots 0..2, scattered blocks, contexts of 20, 3 and 40 tokens."""
    requests = []
    for i, (tables, computed) in enumerate((([0, 1], 20), ([2], 3), ([3, 4, 5], 40))):
        request = Request(f"r{i}", list(range(3, 3 + computed + 1)), SamplingParams(), 4, i)
        request.block_table, request.state_slot, request.num_computed_tokens = tables, i, computed
        requests.append(request)
    return requests


def _graphs(tiny_model_path, replay_window: int = 0) -> DecodeGraphs:
    llm = LLM(
        model=str(tiny_model_path),
        dtype="float32",
        max_model_len=256,
        pad_decode_batches=True,
        replay_window=replay_window,
    )
    engine = llm.engine
    assert engine.padding is not None
    runner = DecodeGraphs(engine.model, engine.caches, engine.padding, 16, 256, torch.device("cpu"))
    runner.load(_requests(), 4)  # three rows and one padding row
    return runner


@pytest.fixture(scope="module")
def graphs(tiny_model_path) -> DecodeGraphs:
    return _graphs(tiny_model_path)


@torch.inference_mode()
def test_graph_forward_has_no_host_sync_or_data_dependent_shape(graphs, monkeypatch):
    stub_triton_kernels(monkeypatch)
    hidden_size = graphs.model.config.hidden_size
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = graphs.forward(4)
    assert tuple(out.shape) == (4, hidden_size)


@torch.inference_mode()
def test_the_torch_references_would_sync_the_host(graphs):
    # no stubs: the torch MoE reads expert counts back to the host, the torch MLA indexes by a mask
    errors = (DataDependentOutputException, DynamicOutputShapeException)
    with pytest.raises(errors), FakeTensorMode(allow_non_fake_inputs=True):
        graphs.forward(4)


@torch.inference_mode()
def test_replay_ssm_graph_forward_reads_its_counts_on_the_device(tiny_model_path, monkeypatch):
    """With ReplaySSM rings, the recorded forward launches the ring kernel in every KDA layer with the
    slots and record counts of the static buffers: nothing the host decides inside it."""
    replay = _graphs(tiny_model_path, replay_window=4)
    ring = replay.caches.replay
    assert ring is not None
    for layer in ring.layers.values():
        layer.counts[1] = 2  # request r1's ring holds two records
    replay.load(_requests(), 4)
    assert replay.replay_counts[:4].tolist() == [0, 2, 0, 0]  # the padding row reads 0
    launches: list[tuple[Any, ...]] = []

    class Recording:
        def __init__(self, kernel: TritonKernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                if self.kernel.name == "replay_step":
                    launches.append(args)

            return launch

    stub_triton_kernels(monkeypatch)
    monkeypatch.setenv(replay_ssm.BACKEND_ENV, "triton")
    with triton_kernel.stand_in(Recording), FakeTensorMode(allow_non_fake_inputs=True):
        out = replay.forward(4)
    assert tuple(out.shape) == (4, replay.model.config.hidden_size)
    assert len(launches) == len(ring.layers)  # one ring kernel per KDA layer
    index, count = launches[0][9], launches[0][10]  # the rows' slots and record counts, as sent
    assert tuple(index.shape) == tuple(count.shape) == (4,)
