"""Input ids a step takes from the last step's samples on the device (async scheduling).

With async scheduling the engine queues step N+1 before it reads step N's sampled ids: a request
decoding in both has, as its N+1 input, a token the host does not know yet. Its row's id goes to the
device as a placeholder (0), and on the device, after the step's one host-to-device copy, each such
row takes its id from step N's sampled tensor (an index_select and an index_copy_, two launches, no
read-back). A CUDA graph's static input buffer is filled the same way before its replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.host_pack import HostPack, long_tensor


@dataclass
class PendingInputs:
    """Single-token rows whose input id is still on the device: row `rows[i]` of the step's input ids
    takes `sampled[sources[i]]` (`sampled`: the last step's ids, one per row that sampled)."""

    rows: list[int]
    sources: list[int]
    sampled: torch.Tensor

    def queue(self, pack: HostPack) -> tuple[int, int]:
        """Add the row and source indices to the step's `pack` (its one copy); ids for `fill`."""
        return pack.add(long_tensor(self.rows)), pack.add(long_tensor(self.sources))

    def fill(self, pack: HostPack, ids: tuple[int, int], input_ids: torch.Tensor) -> None:
        """After `pack` went to the device: write the sampled ids into `input_ids`, there."""
        rows, sources = (pack.get(i) for i in ids)
        input_ids.index_copy_(0, rows, self.sampled.index_select(0, sources))
