"""Kimi Delta Attention in plain torch: the chunked prefill form and the one-step decode form.

Both follow transformers' reference (`torch_chunk_kda`, the recurrent loop): per key channel
decay `S <- S * exp(g)`, delta rule `u = beta * (v - S^T k)`, `S <- S + k u^T`, `o = S^T q`,
with q and k L2-normalised in fp32 and q scaled by `1/sqrt(d_k)`. All math is fp32.

Right-padding a sequence with `k = v = g = beta = 0` leaves its state exactly unchanged, which
is what lets sequences of different lengths share one padded call.

The chunked form splits the work in two: everything local to a chunk (decays, the WY
transform, the causal intra-chunk scores) runs at once over every chunk of every row, and
only the state passing walks the chunks in order. `kda_chunked_varlen` packs the rows of a
flat batch chunk by chunk instead of padding every row to the longest, so a batch of mixed
prompt lengths computes no padding beyond each row's last chunk.
"""

from __future__ import annotations

import torch

# Tokens per chunk. The intra-chunk decay tensor is [chunks, H, C, C, Dk], C times the inputs,
# so a smaller chunk costs less elementwise work; the sequential state pass runs L / C steps.
# On bench-10m (2,048-token prefill steps, 1 thread) 8 takes 22 ms a layer, 16 39 ms, 4 19 ms.
CHUNK_SIZE = 8
# The most bytes of per-chunk starting states the state pass keeps before computing outputs.
STATE_BUDGET_BYTES = 64 << 20


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
    state = state.clone()
    return kda_recurrent_step_(q, k, v, g, beta, state), state


def kda_recurrent_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """`kda_recurrent_step` updating `state` in place (no new state tensor); returns the output."""
    state.mul_(g.exp().unsqueeze(-1))
    kv_mem = (k.unsqueeze(-2) @ state).squeeze(-2)  # S^T k as a row-vector product: one bmm, no copy
    u = (v - kv_mem).mul_(beta.unsqueeze(-1))
    state.addcmul_(k.unsqueeze(-1), u.unsqueeze(-2))
    return (q.unsqueeze(-2) @ state).squeeze(-2)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Many tokens per row, chunk-parallel (WY form). Shapes [B, H, L, D] / beta [B, H, L].

    q and k arrive L2-normalised, q already scaled; `state` [B, H, Dk, Dv] fp32 is the state
    before the first token. Returns (output [B, H, L, Dv], state after the last token).
    """
    batch, heads, length, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk_size
    if pad:
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, pad))
    num_chunks = (length + pad) // chunk_size

    def chunk_major(x: torch.Tensor) -> torch.Tensor:  # [B, H, N*C, D] -> [N*B*H, C, D]
        x = x.reshape(batch, heads, num_chunks, chunk_size, -1)
        return x.permute(2, 0, 1, 3, 4).reshape(num_chunks * batch * heads, chunk_size, -1)

    b = beta.unsqueeze(-1)
    out, final = _chunk_scan(
        chunk_major(q),
        chunk_major(k),
        chunk_major(v),
        chunk_major(g),
        chunk_major(b).squeeze(-1),
        state.reshape(batch * heads, dk, dv),
        [batch * heads] * num_chunks,
    )
    out = out.view(num_chunks, batch, heads, chunk_size, dv).permute(1, 2, 0, 3, 4)
    return out.reshape(batch, heads, num_chunks * chunk_size, dv)[:, :, :length], final.view_as(state)


def kda_chunked_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    out: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_chunked` on rows of a flat token batch, without padding rows to the longest.

    q, k, g: [T, H, Dk]; v: [T, H, Dv]; beta: [T, H]; row b's tokens are `starts[b]` ..
    `starts[b] + lengths[b] - 1`; `state` [B, H, Dk, Dv] fp32 holds each row's state before its
    first token. Returns (output [T, H, Dv]: written into `out` when given, which keeps its other
    tokens, else zero at tokens no row names; the states after each row's last token [B, H, Dk, Dv]).
    """
    num_tokens, heads, dk = k.shape
    dv = v.shape[-1]
    dev = q.device
    rows = len(lengths)
    num_chunks = [-(-n // chunk_size) for n in lengths]
    # rows longest first: the rows still running at chunk step n are then a prefix
    order = sorted(range(rows), key=lambda r: -num_chunks[r])
    sorted_chunks = torch.tensor([num_chunks[r] for r in order], device=dev)
    steps = torch.arange(max(num_chunks), device=dev)
    step_of, row_of = (sorted_chunks.unsqueeze(0) > steps.unsqueeze(1)).nonzero(as_tuple=True)
    rows_per_step = [sum(1 for n in num_chunks if n > s) for s in range(max(num_chunks))]
    # packed chunk c (step-major) holds row row_of[c]'s tokens step_of[c] * C .. + C - 1
    offset = step_of.unsqueeze(1) * chunk_size + torch.arange(chunk_size, device=dev)  # [NC, C]
    sorted_starts = torch.tensor([starts[r] for r in order], device=dev)
    sorted_lengths = torch.tensor([lengths[r] for r in order], device=dev)
    real = offset < sorted_lengths[row_of].unsqueeze(1)
    index = torch.where(real, sorted_starts[row_of].unsqueeze(1) + offset, num_tokens)  # T: a zero row
    # every input in one [T + 1, H, W] buffer (last row zero), gathered once straight into packed
    # order [NC, H, C, W] through its (token, head) rows, then split into views: one copy in all
    widths = [dk, dk, dv, dk, 1]
    inputs = q.new_zeros(num_tokens + 1, heads, sum(widths))
    torch.cat([q, k, v, g, beta.unsqueeze(-1)], dim=-1, out=inputs[:num_tokens])
    heads_t = torch.arange(heads, device=dev).view(1, heads, 1)
    pair = (index.unsqueeze(1) * heads + heads_t).view(-1)  # [NC * H * C] rows of inputs.view(-1, W)
    chunks = inputs.view(-1, inputs.shape[-1]).index_select(0, pair).view(-1, chunk_size, sum(widths))
    q_p, k_p, v_p, g_p, beta_p = chunks.split(widths, dim=-1)
    order_t = torch.tensor(order, device=dev)
    chunk_out, final = _chunk_scan(
        q_p,
        k_p,
        v_p,
        g_p,
        beta_p.squeeze(-1),
        state[order_t].reshape(rows * heads, dk, dv),
        [n * heads for n in rows_per_step],
    )
    flat = q.new_zeros(num_tokens, heads, dv) if out is None else out
    kept = real.unsqueeze(1).expand(-1, heads, -1).reshape(-1).nonzero().squeeze(1)  # non-padding
    flat.view(-1, dv).index_copy_(0, pair[kept], chunk_out.view(-1, dv).index_select(0, kept))
    new_state = torch.empty_like(state)
    new_state[order_t] = final.view(rows, heads, dk, dv)
    return flat, new_state


def _chunk_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    active_per_step: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked delta rule on packed chunks. q, k, g: [M, C, Dk]; v: [M, C, Dv]; beta: [M, C].

    Chunks are step-major: step n's chunks are the next `active_per_step[n]` entries, and they
    continue the first `active_per_step[n]` states of `state` [S, Dk, Dv] (so the sequences
    still running at a step are always a prefix). Returns (output [M, C, Dv], the final states).
    """
    chunk = k.shape[1]
    g = g.cumsum(dim=1)
    # decay[m, i, j, d] = exp(G_i - G_j), wanted for j <= i only. No mask pass: above the
    # diagonal it may overflow (inf, and inf * 0 = nan), but score (i, j) below reads only
    # decay[m, i, j] (row j of a matmul) and tril drops every score above the diagonal.
    decay = (g.unsqueeze(2) - g.unsqueeze(1)).exp_()
    decay.mul_(k.unsqueeze(1))  # times k_j: one [M, C, C, Dk] tensor serves both score matrices
    k_beta = k * beta.unsqueeze(-1)
    # scores[m, i, j, 0] = beta_i k_i . (k_j exp(G_i - G_j)); [.., 1] the same with q_i: one
    # contraction. As an einsum, not `decay @ [M, C, Dk, 2]`: that is M * C matmuls two columns
    # wide, 2.5-3x slower on the CPU from the tiny model's heads to Kimi-48B's.
    scores = torch.einsum("mijd,mixd->mijx", decay, torch.stack([k_beta, q], dim=2))  # [M, C, C, 2]
    del decay
    a = scores[..., 0].tril(-1)
    intra = scores[..., 1].tril()
    # T = (I + A)^-1 (forward substitution), then the WY transform of values and keys
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    t = torch.linalg.solve_triangular(a + eye, eye.expand_as(a), upper=False, unitriangular=True)
    g_exp = g.exp()
    w_values = t @ (v * beta.unsqueeze(-1))
    w_keys = t @ (k_beta * g_exp)
    q_decayed = q * g_exp
    g_last = g[:, -1:, :]  # [M, 1, Dk]
    k_to_end_t = (k * (g_last - g).exp()).transpose(1, 2)  # [M, Dk, C]
    decay_last = g_last.exp().transpose(1, 2)  # [M, Dk, 1]
    return _state_pass(q_decayed, intra, w_values, w_keys, k_to_end_t, decay_last, state, active_per_step)


def _state_pass(
    q_decayed: torch.Tensor,
    intra: torch.Tensor,
    w_values: torch.Tensor,
    w_keys: torch.Tensor,
    k_to_end_t: torch.Tensor,
    decay_last: torch.Tensor,
    state: torch.Tensor,
    active_per_step: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential part of `_chunk_scan`: each chunk's state, then every output at once.

    Only `v_new = w_values - w_keys S` and `S <- S * decay_last + k_to_end^T v_new` depend on
    the previous chunk, so the loop runs just those (three ops a chunk, on views split once, no
    per-chunk slicing or copying) and keeps each chunk's starting state; the outputs
    `q_decayed S + intra v_new` then take two batched matmuls. The kept states are bounded by
    `STATE_BUDGET_BYTES`: past it the steps run in windows, each window's outputs computed before
    the next starts. Returns (output [M, C, Dv], the final states in `state`'s order).
    """
    num_states, dk, dv = state.shape
    per_step_bytes = max(1, num_states * dk * dv * state.element_size())
    window = max(1, STATE_BUDGET_BYTES // per_step_bytes)  # steps per window
    out = torch.empty_like(w_values)
    v_new = torch.empty_like(w_values)
    final = torch.empty_like(state)
    carry, start = state, 0  # carry: the states before the window's first step
    for first in range(0, len(active_per_step), window):
        steps = active_per_step[first : first + window]
        after = active_per_step[first + window] if first + window < len(active_per_step) else 0
        stop = start + sum(steps)
        before = state.new_empty(stop - start, dk, dv)  # before[c]: the state chunk c starts from
        parts = before.split(steps)
        parts[0].copy_(carry[: steps[0]])
        carry = state.new_empty(after, dk, dv)
        span = slice(start, stop)
        views = zip(
            w_values[span].split(steps),
            w_keys[span].split(steps),
            v_new[span].split(steps),
            k_to_end_t[span].split(steps),
            decay_last[span].split(steps),
        )
        for n, (wv, wk, vn, kt, dl) in enumerate(views):
            s, active = parts[n], steps[n]
            torch.baddbmm(wv, wk, s, alpha=-1.0, out=vn)
            following = steps[n + 1] if n + 1 < len(steps) else after
            target = parts[n + 1] if n + 1 < len(steps) else carry
            if following == active:
                torch.baddbmm(s * dl, kt, vn, out=target)
                continue
            new = torch.baddbmm(s * dl, kt, vn)  # rows past `following` end here (longest first)
            target.copy_(new[:following])
            final[following:active] = new[following:]
        torch.baddbmm(q_decayed[span] @ before, intra[span], v_new[span], out=out[span])
        start = stop
    return out, final
