"""Each tensor-parallel rank loads its own slices of the checkpoint and nothing else: its parameters
equal the cuts of the single-rank model's, for both checkpoint layouts, with and without expert
parallelism, and the bytes it reads from the files are exactly the bytes it keeps."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from splitserve.engine import loader
from splitserve.engine.loader import load_model
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.ops.moe_reference import moe_experts_torch
from splitserve.engine.parallel.group import TensorParallel
from splitserve.engine.parallel.shard import Shard, placements, shard_of
from splitserve.tiny_model import make_tiny_model

CHECKPOINT = dict(q_lora_rank=24, n_group=4, topk_group=2, attention_bias=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tp-shards"), seed=3, **CHECKPOINT)


@pytest.fixture(scope="module")
def in_memory_checkpoint(checkpoint, tmp_path_factory):
    """The same weights in transformers' in-memory layout (fused experts, one conv1d per layer)."""
    from transformers import KimiLinearForCausalLM

    path = tmp_path_factory.mktemp("in-memory")
    shutil.copytree(checkpoint, path, dirs_exist_ok=True)
    state = KimiLinearForCausalLM.from_pretrained(str(checkpoint)).state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    (path / "model.safetensors").unlink()
    save_file({n: t.contiguous() for n, t in state.items()}, path / "model.safetensors")
    return path


def _cut(full: torch.Tensor, shard: Shard | None, local_shape: torch.Size) -> torch.Tensor:
    """What a rank should hold of `full`, cut independently of the loader's placement code."""
    if shard is None:
        return full
    parts = full.chunk(shard.parts, dim=shard.dim)
    return torch.cat([p.chunk(shard.num_ranks, dim=shard.dim)[shard.rank] for p in parts], dim=shard.dim)


@pytest.mark.parametrize("layout", ["saved", "in_memory"])
@pytest.mark.parametrize("size,expert_parallel", [(2, False), (4, False), (2, True), (4, True)])
def test_each_rank_holds_its_cut_of_every_parameter(
    checkpoint, in_memory_checkpoint, layout, size, expert_parallel
):
    path = checkpoint if layout == "saved" else in_memory_checkpoint
    config = KimiLinearModelConfig.from_pretrained(path)
    whole = dict(load_model(config, path, torch.float32, "cpu").named_parameters())
    cut_somewhere = set()
    for rank in range(size):
        tp = TensorParallel(rank, size, expert_parallel)
        model = load_model(config, path, torch.float32, "cpu", tp)
        for name, param in model.named_parameters():
            shard = shard_of(param)
            if shard is not None:
                cut_somewhere.add(name)
            want = _cut(whole[name], shard, param.shape)
            if rank and name.endswith("o_proj.bias"):  # summed over the ranks: rank 0 alone adds it
                want = torch.zeros_like(want)
            torch.testing.assert_close(param, want, atol=0, rtol=0, msg=f"rank {rank}: {name}")
    # the heads of both attentions, the MLPs, the experts and the vocabulary are all cut
    for part in (
        "q_b_proj",
        "kv_b_proj",
        "self_attn.q_proj",
        "b_proj",
        "A_log",
        "experts.w13",
        "shared_experts",
    ):
        assert any(part in n for n in cut_somewhere), part
    assert "lm_head.weight" in cut_somewhere and "model.embed_tokens.weight" in cut_somewhere


def test_a_rank_reads_only_the_bytes_it_keeps(checkpoint, monkeypatch):
    read = []

    class Counting:
        def __init__(self, lazy):
            self.lazy = lazy

        def get_shape(self):
            return self.lazy.get_shape()

        def __getitem__(self, index):
            t = self.lazy[index]
            read.append(t.numel() * t.element_size())
            return t

    original = loader.iter_checkpoint
    monkeypatch.setattr(loader, "iter_checkpoint", lambda path: ((n, Counting(s)) for n, s in original(path)))
    config = KimiLinearModelConfig.from_pretrained(checkpoint)
    full_bytes = 0
    for size in (1, 4):
        read.clear()
        model = load_model(
            config,
            checkpoint,
            torch.float32,
            "cpu",
            TensorParallel(1, size, True) if size > 1 else TensorParallel(),
        )
        kept = sum(p.numel() * p.element_size() for p in model.parameters())
        kept += sum(b.numel() * b.element_size() for b in model.buffers())
        assert sum(read) == kept
        if size == 1:
            full_bytes = kept
    assert kept < 0.4 * full_bytes  # a rank of 4 reads well under half the checkpoint


def test_placements_of_a_piece_that_straddles_two_ranks():
    # a fused gate; up dim of 8 rows (2 parts) over 2 ranks: rank 1 keeps rows 2-3 and 6-7
    shard = Shard(dim=0, rank=1, num_ranks=2, parts=2)
    # an up piece (rows 4..7 of the full tensor) lands in the rank's rows 2..3, from its rows 2..3
    got = list(placements((4, 5), shard, (4, 0), (4, 5)))
    assert got == [((slice(2, 4), slice(0, 5)), (slice(2, 4), slice(0, 5)))]
    # the whole tensor: two runs
    got = list(placements((4, 5), shard, (0, 0), (8, 5)))
    assert [src[0] for src, _ in got] == [slice(2, 4), slice(6, 8)]
    assert [dst[0] for _, dst in got] == [slice(0, 2), slice(2, 4)]
    # a piece the rank keeps none of
    assert list(placements((4, 5), Shard(0, 0, 2), (4, 0), (2, 5))) == []


def test_choices_of_experts_on_other_ranks_add_nothing():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=gen)
    w13, w2 = torch.randn(4, 6, 8, generator=gen), torch.randn(4, 8, 3, generator=gen)
    ids = torch.tensor([[0, 3], [1, 2], [2, 0], [3, 1], [1, 0]])
    weights = torch.rand(5, 2, generator=gen)
    whole = moe_experts_torch(x, w13, w2, weights, ids)
    # two ranks of two experts each: each computes its choices, the others named "elsewhere" (id 2)
    summed = torch.zeros_like(whole)
    for first in (0, 2):
        local = ids - first
        here = (local >= 0) & (local < 2)
        summed += moe_experts_torch(
            x, w13[first : first + 2], w2[first : first + 2], weights * here, local.masked_fill(~here, 2)
        )
    torch.testing.assert_close(summed, whole)
