"""The ReplaySSM rings of one engine: per KDA layer and state slot, the records since its checkpoint.

With rings, a KDA layer's `kda_recurrent[slot]` is the slot's *checkpoint*, not its state: the
state is `rebuild(checkpoint, records)` (ops/replay_ssm.py). A decode step appends one record and
writes the state only when the ring is full (`fold`, every `window` steps). So whoever reads a
slot's recurrent state outside a forward must `flush(slot)` first (state_transfer.extract_kda
does); flushing is always exact, whenever it happens. A slot handed out afresh holds no records
(`reset`, called by the slot allocator).

Counts live on the host (no device read decides anything). `take_folds` names the slots whose
every layer folded in the forwards since it was last called: their records are still in the ring
buffers until the slot's next step, which is when a decode worker copies them to publish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
        slots: list[int],
    ) -> torch.Tensor:
        """One decode step of rows in `slots` (`index`: the same on the device); returns the output
        [N, H, Dv]. Appends each row's record and folds the rings that filled."""
        pos = torch.tensor([self.counts[s] for s in slots], dtype=torch.long, device=self.k.device)
        if replay_backend(q.device) == "triton":
            from splitserve.engine.ops.replay_ssm_triton import replay_step_triton

            # the kernel stores the records and folds full rings itself; only the counts are ours
            out = replay_step_triton(q, k, v, g, beta, self.checkpoint, self.k, self.u, self.g, index, pos)
            for s in slots:
                self.counts[s] += 1
                if self.counts[s] == self.window:
                    self.counts[s] = 0
                    self.folded.add(s)
            return out
        out, u, g_cum = replay_step(
            q, k, v, g, beta, self.checkpoint[index], self.k[index], self.u[index], self.g[index], pos
        )
        self.k[index, pos], self.u[index, pos], self.g[index, pos] = k, u, g_cum
        for s in slots:
            self.counts[s] += 1
        self.fold([s for s in slots if self.counts[s] == self.window])
        return out

    def fold(self, slots: list[int]) -> None:
        """Write the state after every held record into the checkpoint of `slots`; rings empty."""
        slots = [s for s in slots if self.counts[s] > 0]
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.long, device=self.k.device)
        steps = torch.tensor([self.counts[s] for s in slots], dtype=torch.long, device=self.k.device)
        self.checkpoint[index] = rebuild(
            self.checkpoint[index], self.k[index], self.u[index], self.g[index], steps
        )
        for s in slots:
            if self.counts[s] == self.window:
                self.folded.add(s)
            self.counts[s] = 0

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
