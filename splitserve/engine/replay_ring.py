"""The ReplaySSM rings of one engine: per KDA layer and state slot, the records since its checkpoint.

With rings, a KDA layer's `kda_recurrent[slot]` is the slot's *checkpoint*, not its state: the
state is `rebuild(checkpoint, records)` (ops/replay_ssm.py). A decode step appends one record and
writes the state only when the ring is full (`fold`, every `window` steps). So whoever reads a
slot's recurrent state outside a forward must `flush(slot)` first (state_transfer.extract_kda
does); flushing is always exact, whenever it happens. A slot handed out afresh holds no records
(`reset`, called by the slot allocator).

Counts live on the host (no device read decides anything). A decode step reads each row's count
from a device tensor the runner sends with the step's other indices (`TokenGroup.replay_counts`), and
the Triton kernel appends the record and folds a filling ring itself, so a CUDA graph of the step
replays all of it; the host moves its counts as it queues the step (each layer's `step` eagerly, or
`advance` after a graph's replay). Padding rows read count 0 on the
scratch slot: they never fill a ring (window 1 aside, where they fold into the scratch slot alone).
`take_folds` names the slots whose every layer folded in the forwards since it was last called:
their records are still in the ring buffers until the slot's next step, which is when a decode
worker copies them to publish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitserve.engine.host_staging import device_tensor
from splitserve.engine.ops.replay_ssm import rebuild, replay_backend, replay_step


@dataclass
class ReplayLayerRing:
    """One KDA layer's rings: records `(k, u, G)` per slot ([slots, window, H, D] fp32) and the
    checkpoint tensor they extend (the layer's recurrent-state pool, [slots, H, Dk, Dv])."""

    checkpoint: torch.Tensor
    k: torch.Tensor
    u: torch.Tensor
    g: torch.Tensor
    counts: list[int]
    folded: set[int] = field(default_factory=set)

    @property
    def window(self) -> int:
        return int(self.k.shape[1])

    def step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        index: torch.Tensor,
        counts: torch.Tensor,
        slots: list[int],
    ) -> torch.Tensor:
        """One decode step of rows in slots `index` holding `counts` records each (both on the
        device, read there: a CUDA graph replays this); returns the output [N, H, Dv]. Appends each
        row's record and folds the rings that fill; then moves the host's counts of `slots` (the
        same slots on the host: a replayed CUDA graph runs none of this Python, and its runner
        calls `ReplayRing.advance` instead). The Triton kernel decides the folds on the device; the
        torch reference folds the slots whose count says so."""
        if replay_backend(q.device) == "triton":
            from splitserve.engine.ops.replay_ssm_triton import replay_step_triton

            out = replay_step_triton(q, k, v, g, beta, self.checkpoint, self.k, self.u, self.g, index, counts)
            self.advance(slots)
            return out
        out, u, g_cum = replay_step(
            q, k, v, g, beta, self.checkpoint[index], self.k[index], self.u[index], self.g[index], counts
        )
        self.k[index, counts], self.u[index, counts], self.g[index, counts] = k, u, g_cum
        full = sorted({s for s in slots if self.counts[s] + 1 == self.window})
        if full:  # the eager reference: which rings fill is the host's to say
            index_full = device_tensor(full, torch.long, self.k.device)
            self.checkpoint[index_full] = rebuild(
                self.checkpoint[index_full],
                self.k[index_full],
                self.u[index_full],
                self.g[index_full],
                self.window,
            )
        self.advance(slots)
        return out

    def fold(self, slots: list[int]) -> None:
        """Write the state after every held record into the checkpoint of `slots`; rings empty."""
        slots = [s for s in slots if self.counts[s] > 0]
        if not slots:
            return
        index = device_tensor(slots, torch.long, self.k.device)
        steps = device_tensor([self.counts[s] for s in slots], torch.long, self.k.device)
        self.checkpoint[index] = rebuild(
            self.checkpoint[index], self.k[index], self.u[index], self.g[index], steps
        )
        for s in slots:
            if self.counts[s] == self.window:
                self.folded.add(s)
            self.counts[s] = 0

    def advance(self, slots: list[int]) -> None:
        """The host's side of a decode step of `slots`: one more record each; a ring that filled
        was folded on the device and starts again."""
        for s in slots:
            self.counts[s] += 1
            if self.counts[s] == self.window:
                self.counts[s] = 0
                self.folded.add(s)

    def records(self, slot: int, num: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of the first `num` records of `slot` (k [num, H, Dk], u [num, H, Dv], G [num, H, Dk])."""
        return self.k[slot, :num].clone(), self.u[slot, :num].clone(), self.g[slot, :num].clone()


class ReplayRing:
    """Every KDA layer's rings for one engine's slots (see the module docstring)."""

    def __init__(self, layers: dict[int, ReplayLayerRing], window: int) -> None:
        self.layers = layers
        self.window = window

    @classmethod
    def allocate(
        cls, kda_recurrent: dict[int, torch.Tensor], window: int, device: torch.device | str
    ) -> ReplayRing:
        """Rings of `window` records for every slot of every KDA layer's recurrent-state pool."""
        if window < 1:
            raise ValueError(f"replay window must be at least 1 step (got {window})")
        layers = {}
        for lid, pool in kda_recurrent.items():
            num_slots, heads, dk, dv = pool.shape
            k, u, g = (
                torch.zeros(num_slots, window, heads, d, dtype=torch.float32, device=device)
                for d in (dk, dv, dk)
            )
            layers[lid] = ReplayLayerRing(pool, k, u, g, [0] * num_slots)
        return cls(layers, window)

    def reset(self, slot: int) -> None:
        """`slot` starts afresh: no records (its checkpoint is whatever the caller writes)."""
        for layer in self.layers.values():
            layer.counts[slot] = 0
            layer.folded.discard(slot)

    def flush(self, slot: int) -> None:
        """Make `kda_recurrent[slot]` the slot's exact state in every layer (fold what it holds)."""
        for layer in self.layers.values():
            if layer.counts[slot]:
                layer.fold([slot])
                layer.folded.discard(slot)  # a partial window: not a publishable fold

    def advance(self, slots: list[int]) -> None:
        """After a replayed decode step of `slots` (a CUDA graph runs no Python): every layer's
        count moves on, as each layer's `step` does in an eager forward."""
        for layer in self.layers.values():
            layer.advance(slots)

    def counts_of(self, slots: list[int]) -> list[int]:
        """Records each of `slots` holds, as a decode step reads them (the same in every layer between steps)."""
        return [self.pending(s) for s in slots]

    def pending(self, slot: int) -> int:
        """Records `slot` holds past its checkpoint (the same in every layer unless flushed mid-forward)."""
        return max(layer.counts[slot] for layer in self.layers.values())

    def take_folds(self) -> set[int]:
        """Slots every layer folded (a full window) since the last call; clears the marks."""
        marks = [layer.folded for layer in self.layers.values()]
        done = set.intersection(*marks) if marks else set()
        for m in marks:
            m.clear()
        return done
