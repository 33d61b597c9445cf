"""ReplaySSM's torch reference against the plain recurrent step: outputs per step, and the state
rebuilt from checkpoint + records after any step, to 1e-5 in fp32, over random gates, lengths and
window sizes (including windows that fold several times)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.ops.kda import kda_recurrent_step, l2norm
from splitserve.engine.ops.replay_ssm import rebuild, replay_step
from splitserve.engine.replay_ring import ReplayRing


def _inputs(gen: torch.Generator, steps: int, rows: int, heads: int, dk: int, dv: int, decay: float):
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q = l2norm(randn(steps, rows, heads, dk)) * dk**-0.5
    k = l2norm(randn(steps, rows, heads, dk))
    v = randn(steps, rows, heads, dv)
    g = -decay * torch.rand(steps, rows, heads, dk, generator=gen)  # log-decay <= 0, as the layer's
    beta = torch.rand(steps, rows, heads, generator=gen)
    state = randn(rows, heads, dk, dv)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seed", range(12))
def test_outputs_and_rebuilt_states_equal_the_step_by_step_ones(seed):
    gen = torch.Generator().manual_seed(seed)
    window = int(torch.randint(1, 20, (1,), generator=gen))
    steps = int(torch.randint(1, 3 * window + 3, (1,), generator=gen))
    rows, heads = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 3, (1,), generator=gen))
    dk, dv = (int(x) for x in torch.randint(2, 17, (2,), generator=gen))
    decay = float(torch.rand(1, generator=gen)) * 4  # strong decays underflow exp(G): still exact
    q, k, v, g, beta, state = _inputs(gen, steps, rows, heads, dk, dv, decay)

    checkpoint = state.clone()
    ring_k, ring_u, ring_g = (torch.zeros(rows, window, heads, d) for d in (dk, dv, dk))
    held, window_states = 0, [state]  # window_states[h]: the state after step h of this window
    for t in range(steps):
        expected, state = kda_recurrent_step(q[t], k[t], v[t], g[t], beta[t], state)
        window_states.append(state)
        count = torch.full((rows,), held, dtype=torch.long)
        out, u, g_cum = replay_step(
            q[t], k[t], v[t], g[t], beta[t], checkpoint, ring_k, ring_u, ring_g, count
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        ring_k[:, held], ring_u[:, held], ring_g[:, held] = k[t], u, g_cum
        held += 1
        for h in range(held + 1):  # the state after every step of the window so far
            rebuilt = rebuild(checkpoint, ring_k, ring_u, ring_g, h)
            torch.testing.assert_close(rebuilt, window_states[h], atol=1e-5, rtol=1e-5)
        if held == window:
            checkpoint, held, window_states = rebuild(checkpoint, ring_k, ring_u, ring_g, held), 0, [state]
    torch.testing.assert_close(rebuild(checkpoint, ring_k, ring_u, ring_g, held), state, atol=1e-5, rtol=1e-5)


def test_rows_at_different_points_of_their_windows_step_together():
    """One batched step over rows holding different record counts (the engine's case)."""
    gen = torch.Generator().manual_seed(3)
    window, heads, dk, dv, rows = 5, 2, 8, 6, 4
    q, k, v, g, beta, state = _inputs(gen, 12, rows, heads, dk, dv, 1.0)
    pool = torch.zeros(rows + 2, heads, dk, dv)
    ring = ReplayRing.allocate({0: pool}, window, "cpu")
    layer = ring.layers[0]
    slots = [5, 1, 3, 0]
    pool[slots] = state
    index = torch.tensor(slots)
    live = state.clone()
    for t in range(12):
        active = [i for i in range(rows) if t >= i]  # row i joins at step i: counts differ
        rows_t = torch.tensor(active)
        expected, new = kda_recurrent_step(
            q[t, rows_t], k[t, rows_t], v[t, rows_t], g[t, rows_t], beta[t, rows_t], live[rows_t]
        )
        live[rows_t] = new
        out = layer.step(
            q[t, rows_t],
            k[t, rows_t],
            v[t, rows_t],
            g[t, rows_t],
            beta[t, rows_t],
            index[rows_t],
            torch.tensor([layer.counts[slots[i]] for i in active]),
            [slots[i] for i in active],
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert sorted(layer.counts[s] for s in slots) != [0] * 4  # some rings hold records now
    for s in slots:
        ring.flush(s)
    torch.testing.assert_close(pool[slots], live, atol=1e-5, rtol=1e-5)
    assert all(layer.counts[s] == 0 for s in slots)


def test_take_folds_names_the_slots_whose_window_filled():
    gen = torch.Generator().manual_seed(4)
    pools = {0: torch.zeros(3, 1, 4, 4), 2: torch.zeros(3, 1, 4, 4)}
    ring = ReplayRing.allocate(pools, 3, "cpu")
    q, k, v, g, beta, _ = _inputs(gen, 4, 1, 1, 4, 4, 1.0)
    for t in range(3):
        counts = torch.tensor(ring.counts_of([2]))
        for layer in ring.layers.values():
            layer.step(q[t], k[t], v[t], g[t], beta[t], torch.tensor([2]), counts, [2])
        assert ring.take_folds() == ({2} if t == 2 else set())
    ring.reset(2)
    assert ring.pending(2) == 0
