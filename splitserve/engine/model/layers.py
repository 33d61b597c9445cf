"""Small building blocks of the Kimi-Linear stack: RMSNorm, gated RMSNorm, the SwiGLU MLP, the
vocabulary-parallel embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.ops.norms import add_rms_norm, gated_rms_norm, rms_norm
from splitserve.engine.parallel.group import SINGLE, TensorParallel
from splitserve.engine.parallel.shard import set_shard


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, as transformers does (ops/norms.py;
    one Triton launch on CUDA). `add_and_norm` also adds a sublayer's output to the residual stream."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(residual + x), residual + x)`; with no residual yet, `(norm(x), x)`."""
        if residual is None:
            return self(x), x
        return add_rms_norm(x, residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """KDA's output norm: fp32 RMSNorm per head, times the weight, times sigmoid(gate) (ops/norms.py;
    one Triton launch on CUDA)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The norm in `dtype` (default x's), of `x` rounded to `dtype` first."""
        return gated_rms_norm(x, gate, self.weight, self.eps, dtype or x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))`; gate and up fused into one matmul at load. Under
    tensor parallelism a rank keeps its intermediate columns and returns its partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        intermediate_size = tp.split(intermediate_size, "an MLP's intermediate size")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None
        set_shard(self.gate_proj.weight, tp.shard(0))
        set_shard(self.up_proj.weight, tp.shard(0))
        set_shard(self.down_proj.weight, tp.shard(1))

    def finalize(self) -> None:
        self.gate_up = fuse_rows([self.gate_proj.weight, self.up_proj.weight])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def fuse_rows(weights: list[nn.Parameter]) -> torch.Tensor:
    """Concatenate weights along dim 0 and make each parameter a view of its rows of the result.

    The separate weights' old storage is freed, so a fused model holds each weight once.
    """
    fused = torch.cat([w.detach() for w in weights])
    start = 0
    for w in weights:
        w.data = fused[start : start + w.shape[0]]
        start += w.shape[0]
    return fused


class VocabEmbedding(nn.Embedding):
    """The token embedding; under tensor parallelism a rank keeps `num_embeddings` rows of the
    vocabulary (rank r: rows r * n..) and gives zeros for ids outside them, so the ranks' outputs
    sum (`TensorParallel.all_reduce`) to the full lookup, exactly (all but one addend are 0)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        rows = tp.split(vocab_size, "vocab_size")
        # given a weight, Embedding skips its normal_ init: on the meta device that init would import
        # torch's Python meta kernels (sympy and ~900 modules, ~150 MiB of RSS); the loader fills it
        super().__init__(rows, hidden_size, _weight=torch.empty(rows, hidden_size))
        self.first_row = tp.rank * rows
        self.tp = tp
        set_shard(self.weight, tp.shard(0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.first_row
        outside = (local < 0) | (local >= self.num_embeddings)
        out = super().forward(local.masked_fill(outside, 0))
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))
