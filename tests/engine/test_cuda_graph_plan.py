"""Which decode buckets exist, which one a batch takes, and why graphs are refused where they cannot run."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import cuda_graph_plan
from splitserve.engine.cuda_graph_plan import (
    DecodePadding,
    batch_sizes,
    bucket_for,
    default_batch_sizes,
    graph_refusal,
    plan_decode_padding,
)
from splitserve.engine_config import EngineConfig

CUDA = torch.device("cuda")  # only compared, never used: these tests run on the CPU


@pytest.mark.parametrize(
    ("max_num_seqs", "sizes"),
    [
        (1, [1]),
        (2, [1, 2]),
        (4, [1, 2, 4]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    ],
)
def test_default_buckets_end_at_max_num_seqs(max_num_seqs, sizes):
    assert default_batch_sizes(max_num_seqs) == sizes


def test_bucket_is_the_smallest_that_holds_the_batch():
    sizes = [1, 2, 4, 8, 16, 24]
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 24)] == [1, 2, 4, 4, 8, 8, 16, 24, 24]
    assert bucket_for(25, sizes) is None  # larger than every bucket: runs eagerly, unpadded
    padding = DecodePadding(sizes, scratch_block=10, scratch_slot=3, use_graphs=False)
    assert padding.bucket(6) == 8


def test_configured_sizes_are_sorted_unique_and_capped_at_max_num_seqs():
    config = EngineConfig(model="m", max_num_seqs=6, cuda_graph_batch_sizes=(8, 3, 1, 3))  # type: ignore[arg-type]
    assert config.cuda_graph_batch_sizes == (1, 3, 8)
    assert batch_sizes(config) == [1, 3]
    assert batch_sizes(EngineConfig(model="m", max_num_seqs=6)) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes must all be at least 1"):
        EngineConfig(model="m", cuda_graph_batch_sizes=(0, 4))


class _Dense(torch.nn.Module):
    pass


class _WithExperts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.Module()
        self.experts.w13 = torch.nn.Parameter(torch.zeros(1))


def test_refusals_name_their_reason(monkeypatch):
    config = EngineConfig(model="m")
    assert "not CUDA" in (graph_refusal(config, _Dense(), torch.device("cpu")) or "")
    assert "enforce_eager" in (graph_refusal(config.replace(enforce_eager=True), _Dense(), CUDA) or "")
    monkeypatch.setenv("SPLITSERVE_REPLAY_BACKEND", "torch")
    assert "ReplaySSM" in (graph_refusal(config.replace(replay_window=16), _Dense(), CUDA) or "")
    monkeypatch.delenv("SPLITSERVE_REPLAY_BACKEND")
    monkeypatch.setenv("SPLITSERVE_MLA_BACKEND", "torch")
    assert "paged MLA" in (graph_refusal(config, _Dense(), CUDA) or "")
    monkeypatch.setattr("splitserve.engine.ops.paged_mla.mla_backend", lambda device: "triton")
    monkeypatch.setattr("splitserve.engine.ops.fused_moe.triton_available", lambda: False)
    assert "routed experts" in (graph_refusal(config, _WithExperts(), CUDA) or "")
    assert graph_refusal(config, _Dense(), CUDA) is None  # no experts: the MoE kernel is not needed
    monkeypatch.setattr("splitserve.engine.ops.fused_moe.triton_available", lambda: True)
    assert graph_refusal(config, _WithExperts(), CUDA) is None
    assert graph_refusal(config.replace(replay_window=16), _WithExperts(), CUDA) is None  # the Triton kernel


def test_plan_pads_only_with_graphs_or_when_asked(monkeypatch):
    config = EngineConfig(model="m", max_num_seqs=4)
    cpu = torch.device("cpu")
    assert plan_decode_padding(config, _Dense(), cpu, 100, 4) is None  # the CPU default: as before
    padding = plan_decode_padding(config.replace(pad_decode_batches=True), _Dense(), cpu, 100, 4)
    assert padding == DecodePadding([1, 2, 4], scratch_block=100, scratch_slot=4, use_graphs=False)
    monkeypatch.setattr(cuda_graph_plan, "graph_refusal", lambda config, model, device: None)
    padding = plan_decode_padding(config, _Dense(), CUDA, 100, 4)
    assert padding is not None and padding.use_graphs
    assert plan_decode_padding(config.replace(cuda_graph_batch_sizes=(8,)), _Dense(), CUDA, 100, 4) is None
