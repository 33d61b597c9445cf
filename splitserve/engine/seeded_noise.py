"""The exponential noise of seeded sampling rows, drawn on the host and optionally ahead of time.

A seeded row's noise is one Exp(1) value per vocabulary token from a CPU generator seeded with the
row's draw seed, so it is the same on every device. It depends only on that seed, which is known
before the step's forward runs: `prepare` draws it while the device computes (the forward is
queued asynchronously on CUDA) and starts its copy to the device from pinned memory, so the host
work (a vocabulary of uniforms per row) and the copy overlap the forward instead of following it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_TINY = torch.finfo(torch.float32).tiny


class SeededNoise:
    """Owns the CPU generator re-seeded for every seeded draw, and the noise prepared for one step.

    Promises: `draw(seeds)` returns exactly the values it would without `prepare` (same generator,
    same order of operations); a prepared batch is used once, by the next `draw` that asks for its
    seeds, and dropped by `clear`.
    """

    def __init__(self, vocab_size: int, device: torch.device, ahead: bool | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.ahead = device.type == "cuda" if ahead is None else ahead  # whether `prepare` draws
        self._generator = torch.Generator()
        self._prepared: dict[int, torch.Tensor] = {}  # draw seed -> its row of noise on the device

    def prepare(self, seeds: Sequence[int]) -> None:
        """Draw the noise of `seeds` now and start copying it to the device (by default on CUDA
        only: on the CPU there is nothing to overlap, and `draw` does the same work when asked)."""
        self.clear()
        unique = list(dict.fromkeys(seeds))
        if not unique or not self.ahead:
            return
        # pinned on CUDA: the copy runs behind the queued forward, not before it (allocated pinned,
        # not copied into pinned memory afterwards: a vocabulary per row is tens of MiB at batch 64)
        host = self._host_noise(unique, pin=self.device.type == "cuda")
        noise = host.to(self.device, non_blocking=True)
        self._prepared = dict(zip(unique, noise.unbind(0)))

    def draw(self, seeds: Sequence[int]) -> torch.Tensor:
        """Exp(1) noise [len(seeds), vocab_size] on the device, row i from seed `seeds[i]`."""
        if seeds and all(s in self._prepared for s in seeds):
            return torch.stack([self._prepared[s] for s in seeds])
        # as `prepare` does, pinned on CUDA: a pageable copy would synchronize the stream
        return self._host_noise(seeds, pin=self.device.type == "cuda").to(self.device, non_blocking=True)

    def clear(self) -> None:
        self._prepared = {}

    def _host_noise(self, seeds: Sequence[int], pin: bool = False) -> torch.Tensor:
        uniform = torch.empty(len(seeds), self.vocab_size, dtype=torch.float32, pin_memory=pin)
        for row, seed in zip(uniform, seeds):
            self._generator.manual_seed(seed)
            row.uniform_(generator=self._generator)
        return uniform.log_().neg_().clamp_min_(_TINY)
