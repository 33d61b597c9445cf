"""ReplaySSM: one KDA decode step read from a checkpoint and a ring of records (the torch reference).

The KDA step (ops/kda.py) is `S' = Diag(exp g) S`, `u = beta (v - S'^T k)`, `S = S' + k u^T`,
`o = S^T q`. Once `u` is recorded the update is linear in the state, so with `G_j` the cumulative
log-decay of steps 1..j since a checkpoint `S_0` (`G_0 = 0`), the state after step h is

    S_h = Diag(exp G_h) S_0 + sum_{j<=h} Diag(exp(G_h - G_j)) k_j u_j^T.

A decode slot therefore keeps `S_0` (never written during the window) and, per step, the record
`(k_j, u_j, G_j)`; it reads each step's `u` and output from them, and folds the records into the
checkpoint once the ring is full (`rebuild` of every record). Anyone holding `S_0` and the records
rebuilds the state after any step of the window (`rebuild`): that is what a decode worker publishes.

Records keep `G` cumulative from the window's checkpoint (not the per-step `g`), so the receiver
folds with bit-identical inputs. All math is fp32. Shapes: rows N, heads H, window L.
"""

from __future__ import annotations

import torch

from splitserve.engine.ops.backend import choose_backend, importable

BACKEND_ENV = "SPLITSERVE_REPLAY_BACKEND"


def replay_backend(device: torch.device) -> str:
    """`triton` on a CUDA device with triton installed, else `torch`; the env var overrides."""
    return choose_backend(BACKEND_ENV, "triton", importable("triton"), "pip install triton", device)


def _weights(g_cum: torch.Tensor, g_now: torch.Tensor, num_records: torch.Tensor) -> torch.Tensor:
    """`exp(G_now - G_j)` for each held record j < num_records, 0 for the rest: [N, L, H, Dk].

    Unheld positions are masked before exp: they hold a past window's values, which may exceed
    `G_now` and would overflow.
    """
    held = torch.arange(g_cum.shape[1], device=g_cum.device).view(1, -1) < num_records.view(-1, 1)
    diff = torch.where(held.view(*held.shape, 1, 1), g_now.unsqueeze(1) - g_cum, float("-inf"))
    return diff.exp()


def replay_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    checkpoint: torch.Tensor,
    ring_k: torch.Tensor,
    ring_u: torch.Tensor,
    ring_g: torch.Tensor,
    num_records: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row, read from checkpoint + ring; nothing is written.

    q, k, g: [N, H, Dk] (q, k L2-normalised, q scaled); v: [N, H, Dv]; beta: [N, H];
    checkpoint: [N, H, Dk, Dv] fp32; ring_k, ring_g: [N, L, H, Dk]; ring_u: [N, L, H, Dv];
    num_records: [N] long, records held (each < L). Returns (output [N, H, Dv], this step's
    record `u` [N, H, Dv] and `G` [N, H, Dk]) for the caller to store at index `num_records`.
    """
    rows = torch.arange(q.shape[0], device=q.device)
    last = (num_records - 1).clamp(min=0)
    g_prev = torch.where((num_records > 0).view(-1, 1, 1), ring_g[rows, last], 0.0)
    g_now = g_prev + g  # G_t
    weights = _weights(ring_g, g_now, num_records)  # [N, L, H, Dk]: exp(G_t - G_j), j < t
    decay = g_now.exp()
    weighted_keys = ring_k * weights
    # S_{t-1} decayed by this step's gate, applied to k: checkpoint part + one term per record
    kv_mem = torch.einsum("nhkv,nhk->nhv", checkpoint, decay * k)
    kv_mem = kv_mem + torch.einsum("nlhk,nhk,nlhv->nhv", weighted_keys, k, ring_u)
    u = (v - kv_mem) * beta.unsqueeze(-1)
    out = torch.einsum("nhkv,nhk->nhv", checkpoint, decay * q)
    out = out + torch.einsum("nlhk,nhk,nlhv->nhv", weighted_keys, q, ring_u)
    out = out + (k * q).sum(-1, keepdim=True) * u  # this step's own record: exp(G_t - G_t) = 1
    return out, u, g_now


def rebuild(
    checkpoint: torch.Tensor,
    ring_k: torch.Tensor,
    ring_u: torch.Tensor,
    ring_g: torch.Tensor,
    num_steps: torch.Tensor | int,
) -> torch.Tensor:
    """The state after step `num_steps` of the window: checkpoint [N, H, Dk, Dv] plus the first
    `num_steps` records ([N, L, H, D]). `num_steps` 0 gives the checkpoint (a copy)."""
    n = checkpoint.shape[0]
    steps = torch.as_tensor(num_steps, dtype=torch.long, device=checkpoint.device).expand(n)
    if ring_k.shape[1] == 0:
        return checkpoint.clone()
    rows = torch.arange(n, device=checkpoint.device)
    last = (steps - 1).clamp(min=0)
    g_end = torch.where((steps > 0).view(-1, 1, 1), ring_g[rows, last], 0.0)  # G_h
    weights = _weights(ring_g, g_end, steps)
    state = checkpoint * g_end.exp().unsqueeze(-1)
    return state + torch.einsum("nlhk,nlhv->nhkv", ring_k * weights, ring_u)
