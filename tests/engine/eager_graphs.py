"""Test helper: the CUDA graph runner without the capture, so the CPU runs what a replay computes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from splitserve.engine.cuda_graph import DecodeGraphs
from splitserve.engine.pending_inputs import PendingInputs
from splitserve.engine.request import Request


class EagerGraphs(DecodeGraphs):
    """The graph runner without capture: each `run` loads the static buffers and calls the forward a
    graph records, so the CPU checks everything a replay computes except the replay itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_runs = 0
        self.num_pending_rows = 0  # rows whose input id came from the last step on the device

    @classmethod
    def install(cls, engine: Any) -> EagerGraphs:
        """Build one for `engine` (made with `pad_decode_batches=True`) and make its runner use it."""
        assert engine.padding is not None, "build the engine with pad_decode_batches=True"
        graphs = cls(
            engine.model,
            engine.caches,
            engine.padding,
            engine.config.block_size,
            engine.max_model_len,
            engine.device,
        )
        engine.runner.graphs = graphs
        return graphs

    def run(
        self, requests: Sequence[Request], size: int, pending: PendingInputs | None = None
    ) -> torch.Tensor:
        self.num_runs += 1
        self.num_pending_rows += len(pending.rows) if pending is not None else 0
        self.load(requests, size, pending)
        return self.forward(size)[: len(requests)]
