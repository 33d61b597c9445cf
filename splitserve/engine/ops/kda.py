"""Kimi Delta Attention in plain torch: the chunked prefill form and the one-step decode form.

Both follow transformers' reference (`torch_chunk_kda`, the recurrent loop): per key channel
decay `S <- S * exp(g)`, delta rule `u = beta * (v - S^T k)`, `S <- S + k u^T`, `o = S^T q`,
with q and k L2-normalised in fp32 and q scaled by `1/sqrt(d_k)`. All math is fp32.

Right-padding a sequence with `k = v = g = beta = 0` leaves its state exactly unchanged, which
is what lets sequences of different lengths share one padded call.
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm: `x / sqrt(sum(x^2) + eps)` (eps inside the root, unlike F.normalize)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. q,k,g: [N, H, Dk]; v: [N, H, Dv]; beta: [N, H]; state: [N, H, Dk, Dv] fp32.

    q and k arrive L2-normalised, q already scaled. Returns (output [N, H, Dv], new state).
    """
    state = state * g.exp().unsqueeze(-1)
    kv_mem = torch.einsum("nhkv,nhk->nhv", state, k)
    u = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * u.unsqueeze(-2)
    out = torch.einsum("nhkv,nhk->nhv", state, q)
    return out, state


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Many tokens per row, chunk-parallel (WY form). Shapes [B, H, L, D] / beta [B, H, L].

    q and k arrive L2-normalised, q already scaled; `state` [B, H, Dk, Dv] fp32 is the state
    before the first token. Returns (output [B, H, L, Dv], state after the last token).
    """
    batch, heads, length, dk = k.shape
    pad = (-length) % chunk_size
    if pad:
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, pad))
    num_chunks = (length + pad) // chunk_size
    q, k, v, g = (x.reshape(batch, heads, num_chunks, chunk_size, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(batch, heads, num_chunks, chunk_size, 1)
    g = g.cumsum(dim=-2)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    strict = causal.logical_not().unsqueeze(-1)  # j > i: masked before exp so it cannot overflow
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict, float("-inf")).exp()
    k_beta = k * beta
    # A[i, j] = beta_i * k_i . (k_j * exp(G_i - G_j)) for j < i; T = (I + A)^-1 (forward substitution)
    a = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", k_beta, k, decay).tril(-1)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    t = torch.linalg.solve_triangular(a + eye, eye.expand_as(a), upper=False, unitriangular=True)
    w_values = t @ (v * beta)
    w_keys = t @ (k_beta * g.exp())
    intra = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", q, k, decay).masked_fill(~causal, 0.0)
    q_decayed = q * g.exp()
    g_last = g[:, :, :, -1:, :]
    k_to_end = k * (g_last - g).exp()
    outputs = []
    for n in range(num_chunks):
        v_new = w_values[:, :, n] - w_keys[:, :, n] @ state
        outputs.append(q_decayed[:, :, n] @ state + intra[:, :, n] @ v_new)
        state = state * g_last[:, :, n].transpose(-1, -2).exp() + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    out = torch.cat(outputs, dim=2)[:, :, :length]
    return out, state
