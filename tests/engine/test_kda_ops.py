"""The torch KDA forms agree: packed varlen chunks, padded chunks and the per-token recurrence."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.ops import kda
from splitserve.engine.ops.kda import kda_chunked, kda_chunked_varlen, kda_recurrent_step, l2norm


def flat_inputs(
    num_tokens: int, heads: int, dim: int, seed: int, decay_scale: float = 1.0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(num_tokens, heads, dim, generator=gen)) * dim**-0.5
    k = l2norm(torch.randn(num_tokens, heads, dim, generator=gen))
    v = torch.randn(num_tokens, heads, dim, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(num_tokens, heads, dim, generator=gen)) * decay_scale
    beta = torch.sigmoid(torch.randn(num_tokens, heads, generator=gen))
    return q, k, v, g, beta


@pytest.mark.parametrize(("chunk_size", "decay_scale"), [(4, 1.0), (16, 1.0), (16, 40.0)])
def test_varlen_equals_the_recurrence_row_by_row(chunk_size, decay_scale):
    """decay_scale 40: log-decays whose sums within a chunk overflow exp the other way round."""
    lengths = [37, 5, 20, 16, 1]
    starts = [3 + sum(lengths[:i]) for i in range(len(lengths))]  # tokens 0..2 belong to no row
    num_tokens = 3 + sum(lengths) + 2
    heads, dim = 2, 8
    q, k, v, g, beta = flat_inputs(num_tokens, heads, dim, seed=0, decay_scale=decay_scale)
    state = torch.randn(len(lengths), heads, dim, dim, generator=torch.Generator().manual_seed(1))
    out = torch.full((num_tokens, heads, dim), 7.0)
    _, final = kda_chunked_varlen(q, k, v, g, beta, state, starts, lengths, out, chunk_size=chunk_size)
    for row, (start, length) in enumerate(zip(starts, lengths)):
        s = state[row : row + 1]
        for t in range(start, start + length):
            expected, s = kda_recurrent_step(
                q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s
            )
            torch.testing.assert_close(out[t : t + 1], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[row : row + 1], s, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:3], torch.full((3, heads, dim), 7.0)), "tokens of no row are left alone"


def test_padded_equals_varlen():
    lengths = [21, 21]
    q, k, v, g, beta = flat_inputs(42, 3, 8, seed=2)
    state = torch.zeros(2, 3, 8, 8)
    out, final = kda_chunked_varlen(q, k, v, g, beta, state, [0, 21], lengths)

    def padded(x: torch.Tensor) -> torch.Tensor:  # [2*21, H, ...] -> [2, H, 21, ...]
        return x.view(2, 21, *x.shape[1:]).transpose(1, 2)

    ref_out, ref_final = kda_chunked(*(padded(x) for x in (q, k, v, g, beta)), state)
    torch.testing.assert_close(padded(out), ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("budget_bytes", [1, 3 * 2 * 8 * 8 * 4 * 2])
def test_state_pass_in_windows_equals_one_window(monkeypatch, budget_bytes):
    """A state budget too small for every chunk's starting state runs the steps in windows (one
    step each, or two with rows ending inside and at a window's edge): the result is unchanged."""
    lengths = [37, 9, 16]
    q, k, v, g, beta = flat_inputs(sum(lengths), 2, 8, seed=3)
    state = torch.randn(len(lengths), 2, 8, 8, generator=torch.Generator().manual_seed(4))
    starts = [0, 37, 46]
    out, final = kda_chunked_varlen(q, k, v, g, beta, state, starts, lengths)
    monkeypatch.setattr(kda, "STATE_BUDGET_BYTES", budget_bytes)
    windowed_out, windowed_final = kda_chunked_varlen(q, k, v, g, beta, state, starts, lengths)
    torch.testing.assert_close(windowed_out, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(windowed_final, final, rtol=1e-6, atol=1e-6)
