"""The forward a decode CUDA graph records has no host sync and no shape that depends on data, checked on
the CPU: under FakeTensorMode any `.item()`, `.tolist()`, `nonzero` or boolean-mask index raises. The
Triton launches (paged MLA, fused MoE) are stubbed; the torch code around them runs. The torch
references, which graphs refuse, are shown to fail the same check."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from splitserve import LLM, SamplingParams
from splitserve.engine.cuda_graph import DecodeGraphs
from splitserve.engine.request import Request
from tests.engine.kernel_stubs import stub_triton_kernels

pytest.importorskip("triton")  # the kernels' Python wrappers import it


@pytest.fixture(scope="module")
def graphs(tiny_model_path) -> DecodeGraphs:
    llm = LLM(model=str(tiny_model_path), dtype="float32", max_model_len=256, pad_decode_batches=True)
    engine = llm.engine
    assert engine.padding is not None
    runner = DecodeGraphs(engine.model, engine.caches, engine.padding, 16, 256, torch.device("cpu"))
    requests = []
    for i, (tables, computed) in enumerate((([0, 1], 20), ([2], 3), ([3, 4, 5], 40))):
        request = Request(f"r{i}", list(range(3, 3 + computed + 1)), SamplingParams(), 4, i)
        request.block_table, request.state_slot, request.num_computed_tokens = tables, i, computed
        requests.append(request)
    runner.load(requests, 4)  # three rows and one padding row
    return runner


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
