"""One rank's place in its engine's tensor-parallel group, and the collectives the model calls.

A group of one (`TensorParallel()`, every engine without `tensor_parallel_size`) does no
communication at all: every method returns its input, so the single-rank path runs exactly the
ops it ran before parallelism existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.parallel.layout import check_splits
from splitserve.engine.parallel.shard import Shard


@dataclass(frozen=True)
class TensorParallel:
    """Which rank of `size` this process is and the process groups it talks through.

    `device_group` carries the model's tensors (NCCL on CUDA, gloo on the CPU); `host_group` (gloo)
    carries host values such as the agreed KV budget. Heads, intermediate columns and vocabulary
    rows split evenly over the ranks; with `expert_parallel` the routed experts do too (each rank
    keeps whole experts), else each expert's intermediate columns split like a dense MLP's.
    """

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    device_group: Any = None
    host_group: Any = None

    def split(self, count: int, what: str) -> int:
        """`count // size`; raises ValueError naming `what` when the ranks cannot split it evenly."""
        if count % self.size:
            raise ValueError(
                f"{what} ({count}) does not split evenly over tensor_parallel_size {self.size}; "
                f"pick a size that divides it"
            )
        return count // self.size

    def check_model(self, model: KimiLinearModelConfig) -> None:
        """Raise ValueError naming the first size of `model` the ranks cannot split evenly (before
        any rank process starts, rather than in each of them)."""
        check_splits(model, self.size, self.expert_parallel)

    def shard(self, dim: int, parts: int = 1) -> Shard | None:
        """The cut a parameter split along `dim` keeps on this rank (None: whole, as with one rank)."""
        return Shard(dim, self.rank, self.size, parts) if self.size > 1 else None

    def expert_shard(self, dim: int, parts: int = 1) -> Shard | None:
        """An expert weight's cut: whole experts (dim 0) with expert parallelism, else along `dim`."""
        return self.shard(0) if self.expert_parallel else self.shard(dim, parts)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (each holds a partial sum of a sublayer's output)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets the ranks' `x` concatenated along the last dim (the vocabulary); others None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, group=self.device_group, group_dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_ids(self, ids: list[int] | None, count: int, device: torch.device) -> list[int]:
        """Rank 0's `count` token ids on every rank (the others pass None)."""
        if self.size == 1:
            assert ids is not None
            return ids
        buf = (
            torch.tensor(ids, dtype=torch.long, device=device)
            if self.rank == 0
            else torch.empty(count, dtype=torch.long, device=device)
        )
        dist.broadcast(buf, group=self.device_group, group_src=0)
        return buf.tolist()

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` any rank holds (e.g. the KV budget every rank can afford)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())


SINGLE = TensorParallel()
