"""Kimi Delta Attention layer: projections, short causal conv, forget gate, delta rule, gated norm.

State per request slot: the last `K-1` pre-conv q/k/v inputs (`conv_state`, [slots, 3*H*D, K-1])
and the recurrent matrix (`recurrent_state`, [slots, H, Dk, Dv], fp32). A slot must be zeroed
before a request's first chunk; every call reads and writes the slots of the rows it runs.
The delta rule runs through `ops.kda_dispatch`: fla's kernels on CUDA, the torch reference elsewhere.

Given a `ReplayLayerRing` (an engine with `replay_window` > 0), single-token rows run in ReplaySSM
form instead: `recurrent_state[slot]` is the slot's checkpoint, each step appends a `(k, u, G)`
record and the ring folds into the checkpoint every window (engine/replay_ring.py). A row taking
a prompt chunk first folds what its ring holds, so the chunk starts from the exact state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.forward_batch import ForwardBatch, TokenGroup
from splitserve.engine.model.layers import GatedRMSNorm, fuse_rows
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.ops.kda_dispatch import kda_backend, kda_decode_into, kda_prefill, kda_prefill_varlen
from splitserve.engine.ops.kda_gates import conv_step_torch, kda_decode_gates, kda_gates_torch
from splitserve.engine.parallel.group import SINGLE, TensorParallel
from splitserve.engine.parallel.shard import set_shard
from splitserve.engine.replay_ring import ReplayLayerRing


class KimiDeltaAttention(nn.Module):
    """One KDA layer; parameters named as in Moonshot/transformers checkpoints, fused at load. Under
    tensor parallelism it holds its rank's heads and returns its partial sum of o_proj's output."""

    def __init__(self, config: KimiLinearModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden = config.hidden_size
        # with tensor parallelism a rank keeps its heads: their q/k/v columns, conv channels, gates
        # and o_proj rows; the low-rank gate inputs (f_a, g_a) and the norm are shared by all heads
        self.num_heads = tp.split(config.linear_num_heads, "linear_num_heads")
        self.head_dim = config.linear_head_dim
        self.kernel_size = config.linear_conv_kernel_dim
        dim = self.num_heads * self.head_dim
        self.qkv_dim = dim
        self.q_proj = nn.Linear(hidden, dim, bias=False)
        self.k_proj = nn.Linear(hidden, dim, bias=False)
        self.v_proj = nn.Linear(hidden, dim, bias=False)
        self.q_conv1d = nn.Conv1d(dim, dim, self.kernel_size, groups=dim, bias=False)
        self.k_conv1d = nn.Conv1d(dim, dim, self.kernel_size, groups=dim, bias=False)
        self.v_conv1d = nn.Conv1d(dim, dim, self.kernel_size, groups=dim, bias=False)
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.num_heads, 1))
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, dim, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(dim, hidden, bias=False)
        by_head = (self.q_proj, self.k_proj, self.v_proj, self.q_conv1d, self.k_conv1d, self.v_conv1d)
        for module in (*by_head, self.f_b_proj, self.b_proj, self.g_b_proj):
            set_shard(module.weight, tp.shard(0))
        set_shard(self.dt_bias, tp.shard(0))
        set_shard(self.A_log, tp.shard(2))
        set_shard(self.o_proj.weight, tp.shard(1))
        self.in_proj = torch.empty(0)  # [3*dim + head_dim + H + head_dim, hidden] after finalize
        self.conv_weight = torch.empty(0)  # [3*dim, K]
        self.decay_rate = torch.empty(0)  # [H, 1] fp32

    def finalize(self) -> None:
        """Fuse the six input projections into one matmul and the three convs into one.

        The separate weights become views of the fused ones, so fusing holds no second copy.
        """
        projections = (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, self.g_a_proj)
        self.in_proj = fuse_rows([p.weight for p in projections])
        self.conv_weight = fuse_rows([c.weight for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])
        self.conv_weight = self.conv_weight.squeeze(1)
        self.decay_rate = self.A_log.float().exp().view(self.num_heads, 1)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        replay: ReplayLayerRing | None = None,
    ) -> torch.Tensor:
        dim, hd, nh = self.qkv_dim, self.head_dim, self.num_heads
        proj = F.linear(x, self.in_proj)
        mixed, f_a, b_logit, g_a = proj.split([3 * dim, hd, nh, hd], dim=-1)
        f = self.f_b_proj(f_a)
        gates = (self.dt_bias, self.decay_rate, nh)
        if batch.multi is None:  # a decode step: conv, norms and gates in one launch on CUDA
            assert batch.single is not None
            slots = batch.single.state_slots
            q, k, v, g, beta = kda_decode_gates(
                mixed, f, b_logit, conv_state, self.conv_weight, slots, *gates
            )
            core = self._delta_step(q, k, v, g, beta, batch.single, recurrent_state, replay)
        else:
            conv_out = torch.empty_like(mixed)
            if batch.single is not None:
                n = batch.single.num_rows
                conv_out[:n] = conv_step_torch(
                    mixed[:n], conv_state, batch.single.state_slots, self.conv_weight
                )
            self._conv_chunk(mixed, batch.multi, conv_state, conv_out)
            q, k, v, g, beta = kda_gates_torch(conv_out, f, b_logit, *gates)
            core = torch.empty_like(v)
            if batch.single is not None:
                n = batch.single.num_rows
                core[:n] = self._delta_step(
                    q[:n], k[:n], v[:n], g[:n], beta[:n], batch.single, recurrent_state, replay
                )
            if replay is not None:
                replay.fold(batch.multi.slot_ids)
            self._delta_chunk(q, k, v, g, beta, batch.multi, recurrent_state, core)
        gate = self.g_b_proj(g_a).view(-1, nh, hd)
        out = self.o_norm(core, gate, x.dtype).reshape(-1, dim)
        return self.o_proj(out)

    def _delta_step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        group: TokenGroup,
        recurrent_state: torch.Tensor,
        replay: ReplayLayerRing | None,
    ) -> torch.Tensor:
        """One token per row of `group`: the delta rule on the rows' states (or their ReplaySSM rings)."""
        if replay is not None:  # each row's record count comes with the step (graph-safe)
            assert group.replay_counts is not None, "a ReplaySSM decode needs the rows' record counts"
            return replay.step(q, k, v, g, beta, group.state_slots, group.replay_counts, group.slot_ids)
        slots = group.state_slots
        if kda_backend(q.device) == "fla":  # fla takes int32 slots: made once per step, shared by the layers
            slots = group.derived.get("kda_slots_int32", slots)
            if slots.dtype != torch.int32:
                slots = group.derived["kda_slots_int32"] = slots.to(torch.int32)
        return kda_decode_into(q, k, v, g, beta, recurrent_state, slots)

    def _conv_chunk(
        self, mixed: torch.Tensor, group: TokenGroup, conv_state: torch.Tensor, out: torch.Tensor
    ) -> None:
        # rows gathered and scattered by index_select / index_copy_: on the CPU several times faster
        # than advanced indexing and index_put_ (which cost more here than the conv itself)
        keep = self.kernel_size - 1
        slots, index = group.state_slots, group.token_index
        padded = mixed.index_select(0, index.view(-1)).view(*index.shape, -1)  # [B, L, C]
        padded.mul_(group.valid.unsqueeze(-1))
        seq = torch.cat([conv_state.index_select(0, slots), padded.transpose(1, 2)], dim=-1)  # [B, C, K-1+L]
        conv = depthwise_conv(seq, self.conv_weight)  # [B, C, L]
        real = F.silu(group.real_tokens(conv.transpose(1, 2)))  # no mask: no sync
        out.index_copy_(0, group.real_token_index(), real)
        lengths = group.valid.sum(dim=1)  # on the device: no host tensor copied in per layer
        cols = lengths.view(-1, 1) + torch.arange(keep, device=seq.device)  # last K-1 real inputs
        conv_state.index_copy_(0, slots, seq.gather(2, cols.unsqueeze(1).expand(-1, seq.shape[1], -1)))

    def _delta_chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        group: TokenGroup,
        recurrent_state: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        slots = group.state_slots
        if kda_backend(q.device) == "torch":  # packed chunks: no padding to the longest row
            starts = group.starts or group.token_index[:, 0].tolist()  # the runner gives them on the host
            state = recurrent_state.index_select(0, slots)
            state = kda_prefill_varlen(q, k, v, g, beta, state, starts, group.lengths, out)
            recurrent_state.index_copy_(0, slots, state)
            return
        idx, valid = group.token_index, group.valid
        mask = valid.unsqueeze(-1).unsqueeze(-1)

        def padded(t: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D], zeros past each end
            return (t[idx] * mask).transpose(1, 2)

        b = (beta[idx] * valid.unsqueeze(-1)).transpose(1, 2)
        o, state = kda_prefill(padded(q), padded(k), padded(v), padded(g), b, recurrent_state[slots])
        recurrent_state[slots] = state
        out[group.real_token_index()] = group.real_tokens(o.transpose(1, 2))


def depthwise_conv(seq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.conv1d(seq, weight.unsqueeze(1), groups=C)` (valid, no padding) as a sum of the kernel's
    shifted taps: seq [B, C, K - 1 + L], weight [C, K] -> [B, C, L]. On the CPU oneDNN's depthwise
    convolution costs ~0.2 ms even for 8 tokens and is 1.6-2x slower than this at every size measured
    (8 to 32k tokens, 192 to 12,288 channels); fp32 results are the same bits. Half types add up in
    fp32 and round once, as the convolution does. Elsewhere (CUDA) the convolution stays one kernel."""
    if seq.device.type != "cpu":
        return F.conv1d(seq, weight.unsqueeze(1), groups=seq.shape[1])
    taps = weight.shape[-1]
    length = seq.shape[-1] - taps + 1
    dtype = seq.dtype
    if dtype in (torch.float16, torch.bfloat16):
        seq, weight = seq.float(), weight.float()
    out = seq[..., :length] * weight[:, :1]
    for k in range(1, taps):
        out.addcmul_(seq[..., k : k + length], weight[:, k : k + 1])
    return out.to(dtype)
