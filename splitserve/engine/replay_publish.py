"""What a decode engine publishes as a request decodes in ReplaySSM form, so another can resume it.

Every time a request's slot folds a full window (every `replay_window` computed tokens), the
engine hands its replay listener a `ReplayPublish`: the state from the previous publish's end
(`token_start`) to `num_tokens`. MLA layers give their KV rows for those tokens; KDA layers give
the window's records when they extend the previous publish exactly and the records published since
the request's last checkpoint (the prompt's end counts as one) would still cost no more than one
checkpoint, else the checkpoint itself (also for a request whose window began elsewhere: after a
resume or a flush), and always the conv state at `num_tokens`. So whoever keeps the pieces needs
at most one checkpoint plus one checkpoint's worth of records per KDA layer to rebuild the latest
state (at the 48B shape, Dk = Dv = 128: 42 tokens of records, so every third publish at window
16 is a checkpoint). A request's first publish starts at its prompt's end, whose state the
prefill already handed off. `replay_resume.py` turns a prompt state and these pieces
back into an `ImportedPrefix`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.engine.replay_ring import ReplayRing
from splitserve.engine.request import Request
from splitserve.engine.state_transfer import LayerState, extract_mla_rows, token_rows
from splitserve.engine_config import EngineConfig
from splitserve.state import HeadRange


@dataclass
class ReplayLayerPiece:
    """One KDA layer's part of a publish: records `(k, u, G)` ([n, H, D] fp32, `G` the cumulative
    log-decay since the state at `token_start`) XOR the recurrent state at `num_tokens`
    (`checkpoint`), and the conv state at `num_tokens`; `heads`: the heads a tensor-parallel
    rank's piece holds (None: every head; a TP engine's publish has one piece per rank and layer)."""

    layer_id: int
    conv: torch.Tensor
    k: torch.Tensor | None = None
    u: torch.Tensor | None = None
    g_cum: torch.Tensor | None = None
    checkpoint: torch.Tensor | None = None
    heads: HeadRange | None = None

    @property
    def num_bytes(self) -> int:
        parts = (self.conv, self.k, self.u, self.g_cum, self.checkpoint)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclass
class ReplayPublish:
    """One request's state from `token_start` to `num_tokens`: copies, owned by the listener (on
    the engine's device: copy them to the host on another thread). `mla` holds each MLA layer's
    KV rows [token_start, num_tokens)."""

    request_id: str
    token_start: int
    num_tokens: int
    kda: list[ReplayLayerPiece]
    mla: list[LayerState]

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.kda) + sum(s.num_bytes for s in self.mla)

    @property
    def has_checkpoint(self) -> bool:
        """Whether its KDA layers carry the recurrent state itself (it needs no earlier KDA part)."""
        return any(p.checkpoint is not None for p in self.kda)


@dataclass
class PendingPublish:
    """A publish copied after its step was queued, handed on once that step's tokens are read
    (async scheduling reads them a step later: the request may have stopped by then)."""

    request: Request
    publish: ReplayPublish
    checkpoint_at: int


# Returns False when it could not take the publish (its queue is full): the next publish of that
# request then starts where the last one it took ended, as a checkpoint (it cannot extend records
# the listener never kept), so the pieces it keeps still chain without a gap.
ReplayListener = Callable[[ReplayPublish], "bool | None"]


class ReplayPublisher:
    """Builds the publishes of one engine after each step (engine thread); remembers per request
    where its last publish ended."""

    def __init__(
        self,
        caches: LayerCaches,
        ring: ReplayRing,
        block_size: int,
        heads: HeadRange | None = None,
        with_mla: bool = True,
    ) -> None:
        self.caches = caches
        self.ring = ring
        self.block_size = block_size
        self.heads = heads  # a tensor-parallel rank's heads, named by each KDA piece (None: every head)
        self.with_mla = with_mla  # False on a rank past the first: rank 0 publishes the MLA rows
        self.listener: ReplayListener | None = None
        self.dropped: list[str] = []  # ids whose publish the listener refused since `take_dropped`
        # request id -> (its arrival number, where its last publish ended, where its last
        # checkpoint is); the arrival tells a request from an earlier one of the same id (an
        # abort leaves its entry behind)
        self._published_to: dict[str, tuple[int, int, int]] = {}

    def after_step(self, requests: list[Request]) -> None:
        """Publish every unfinished request among `requests` (this step's) whose slot folded a
        full window; forget the finished ones (`collect` and `deliver` at once)."""
        self.deliver(requests, self.collect(requests))

    def collect(self, requests: list[Request]) -> list[PendingPublish]:
        """Right after a step is queued, before the next (whose records overwrite the window's):
        copies of what each request among `requests` not finished by now publishes for the windows
        the step folded. `deliver` hands them on once the step's tokens are read."""
        folded = self.ring.take_folds()
        if not folded or self.listener is None:
            return []
        collected = []
        for req in requests:
            if not (req.finished or req.prefill_only) and req.state_slot in folded:
                publish, checkpoint_at = self._publish(req)
                collected.append(PendingPublish(req, publish, checkpoint_at))
        return collected

    def deliver(self, requests: list[Request], collected: list[PendingPublish]) -> None:
        """The step's tokens are read and its stops applied: forget the finished requests among
        `requests`, hand the listener the publishes of the others."""
        for req in requests:
            if req.finished or req.prefill_only:
                self._published_to.pop(req.request_id, None)
        for pending in collected:
            req = pending.request
            if req.finished or self.listener is None:
                continue
            if self.listener(pending.publish) is not False:
                self._published_to[req.request_id] = (
                    req.arrival,
                    pending.publish.num_tokens,
                    pending.checkpoint_at,
                )
            elif self.heads is not None:  # tensor parallel: the other ranks must follow (`take_dropped`)
                self.dropped.append(req.request_id)

    def take_dropped(self) -> dict[str, tuple[int, int, int] | None]:
        """Where each request whose publish the listener refused since the last call stands now
        (None: nowhere), for a tensor-parallel engine's ranks to take (`follow`)."""
        dropped, self.dropped = self.dropped, []
        return {rid: self._published_to.get(rid) for rid in dropped}

    def follow(self, standing: dict[str, tuple[int, int, int] | None]) -> None:
        """Take rank 0's standing of the requests whose publish its listener refused (a rank's own
        listener keeps every one), so every rank's next publishes start at the same token."""
        for rid, entry in standing.items():
            if entry is None:
                self._published_to.pop(rid, None)
            else:
                self._published_to[rid] = entry

    def records_fit(self, num_tokens: int) -> bool:
        """Whether records of `num_tokens` tokens (`n x H x (2 Dk + Dv)` per layer) cost no more
        than one checkpoint (`H x Dk x Dv`): at the 48B shape up to 42 tokens, tiny heads (16) 5."""
        layer = next(iter(self.ring.layers.values()))
        per_token = (layer.k[0].numel() + layer.u[0].numel() + layer.g[0].numel()) // self.ring.window
        return num_tokens * per_token <= layer.checkpoint[0].numel()

    def _publish(self, req: Request) -> tuple[ReplayPublish, int]:
        """The request's publish and where its latest checkpoint is once it is taken."""
        assert req.state_slot is not None
        slot, window, end = req.state_slot, self.ring.window, req.num_computed_tokens
        first = (req.arrival, req.num_prompt_tokens, req.num_prompt_tokens)
        arrival, start, checkpoint_at = self._published_to.get(req.request_id, first)
        if arrival != req.arrival:
            _, start, checkpoint_at = first
        # records only while everything since the last checkpoint stays within one checkpoint's bytes
        extends = end - window == start and self.records_fit(end - checkpoint_at)
        kda = []
        for lid, layer in self.ring.layers.items():
            piece = ReplayLayerPiece(lid, self.caches.kda_conv[lid][slot].clone(), heads=self.heads)
            if extends:
                piece.k, piece.u, piece.g_cum = layer.records(slot, window)
            else:
                piece.checkpoint = layer.checkpoint[slot].clone()
            kda.append(piece)
        mla = []
        if self.with_mla:
            rows = token_rows(req.block_table, end, self.block_size, start)
            mla = [extract_mla_rows(self.caches, lid, rows, start, end) for lid in self.caches.mla_kv]
        return ReplayPublish(req.request_id, start, end, kda, mla), checkpoint_at if extends else end


def replay_publisher(
    caches: LayerCaches,
    config: EngineConfig,
    device: torch.device,
    heads: HeadRange | None = None,
    with_mla: bool = True,
) -> ReplayPublisher | None:
    """Rings for every KDA slot and their publisher when `config.replay_window` > 0, else None
    (`heads`, `with_mla`: a tensor-parallel rank's, see `ReplayPublisher`)."""
    if not config.replay_window or not caches.kda_recurrent:
        return None
    caches.replay = ReplayRing.allocate(caches.kda_recurrent, config.replay_window, device)
    return ReplayPublisher(caches, caches.replay, config.block_size, heads, with_mla)
