"""A tensor-parallel rank's share of a KDA state's heads, and re-sharding on read.

A rank of N holds heads `rank_heads(H, rank, N)` of every KDA layer: its conv window and recurrent
state, its prefix snapshots and ReplaySSM records. Each form of KDA state holds its heads on one
axis once viewed as [P, h, R]:

* conv window [3 h D, K - 1] (q, k and v channels, each head-major): [3, h, D (K - 1)];
* recurrent state or checkpoint [h, Dk, Dv]: [1, h, Dk Dv];
* ReplaySSM records [n, h, Dk + Dv + Dk] (KDA_RECURRENT with token_start > 0, replay_codec.py): as is.

So a writer at one width names its share (`LayerState.heads`, carried by every chunk) and a reader
at another takes, from each piece whose heads overlap its own, exactly the overlap (`copy_heads`,
`assemble`): no rank gathers the whole state. MLA rows have no heads (every rank holds the latent).
A reader that rebuilds a state itself (a stored resume: ReplaySSM pieces on a prompt state) takes
every head of each (`whole_heads`) and lets its engine re-shard the result on the way in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from splitserve.engine.state_transfer import LayerState
from splitserve.state import CorruptStateError, HeadRange, StateKind


def rank_heads(num_heads: int, rank: int, num_ranks: int) -> HeadRange:
    """The heads rank `rank` of `num_ranks` holds (they split evenly: the engine refuses otherwise)."""
    share = num_heads // num_ranks
    return HeadRange(rank * share, (rank + 1) * share, num_heads)


def is_records(state: LayerState) -> bool:
    """Whether a KDA_RECURRENT state is a run of ReplaySSM records rather than a state."""
    return state.kind is StateKind.KDA_RECURRENT and state.token_start > 0


def heads_of(state: LayerState, num_heads: int) -> HeadRange:
    """The heads `state` holds: its share, or every head of the model's `num_heads`."""
    return state.heads if state.heads is not None else HeadRange(0, num_heads, num_heads)


def by_head(state: LayerState, num_heads_here: int, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """`tensor` (default the state's own) in `state`'s layout, holding `num_heads_here` heads,
    viewed [P, h, R] (see the module)."""
    t = state.tensor if tensor is None else tensor
    if state.kind is StateKind.MLA_KV:
        raise ValueError(f"layer {state.layer_id}: MLA rows have no heads to split")
    if state.kind is StateKind.KDA_CONV:
        return t.view(3, num_heads_here, -1)
    if is_records(state):
        return t.view(t.shape[0], num_heads_here, -1)
    return t.view(1, num_heads_here, -1)


def _shape_for(state: LayerState, have: int, want: int) -> tuple[int, ...]:
    """The shape `state`'s tensor would have holding `want` heads instead of its `have`."""
    shape = list(state.tensor.shape)
    axis = 1 if is_records(state) else 0
    shape[axis] = shape[axis] // have * want
    return tuple(shape)


def copy_heads(src: LayerState, dst: torch.Tensor, dst_heads: HeadRange, num_heads: int) -> int:
    """Copy the heads `src` and `dst` (holding `dst_heads`, in `src`'s layout) have in common into
    `dst`; returns how many heads it copied (0 when they share none)."""
    have = heads_of(src, num_heads)
    lo, hi = max(have.start, dst_heads.start), min(have.end, dst_heads.end)
    if lo >= hi:
        return 0
    src_view = by_head(src, have.end - have.start)
    dst_view = by_head(src, dst_heads.end - dst_heads.start, dst)
    if src_view.shape[::2] != dst_view.shape[::2]:
        raise CorruptStateError(
            f"layer {src.layer_id} {src.kind.value}: a piece of shape {tuple(src.tensor.shape)} does not fit "
            f"a state of shape {tuple(dst.shape)} (head sizes differ: prefill and decode serve another model?)"
        )
    dst_view[:, lo - dst_heads.start : hi - dst_heads.start] = src_view[:, lo - have.start : hi - have.start]
    return hi - lo


def narrow_heads(state: LayerState, want: HeadRange) -> LayerState:
    """A copy of the heads `want` of `state` (which holds all of them): what a rank writes."""
    have = heads_of(state, want.num_heads)
    shape = _shape_for(state, have.end - have.start, want.end - want.start)
    out = torch.empty(shape, dtype=state.tensor.dtype, device=state.tensor.device)
    copied = copy_heads(state, out, want, want.num_heads)
    if copied != want.end - want.start:
        raise ValueError(
            f"layer {state.layer_id}: the state holds heads {tuple(have)}, not all of {tuple(want)}"
        )
    result = LayerState(
        state.layer_id, state.kind, out, state.token_start, state.token_end, state.num_prompt_tokens
    )
    return _with_heads(result, want)


def assemble(pieces: Iterable[LayerState], want: HeadRange) -> LayerState:
    """The heads `want` of one layer's state (one kind) from pieces of any widths that together
    hold them (a reader re-sharding on read). Raises CorruptStateError if a head is missing."""
    pieces = list(pieces)
    if not pieces:
        raise CorruptStateError(f"no pieces to take heads {tuple(want)} from")
    first = pieces[0]
    have = heads_of(first, want.num_heads)
    out = torch.empty(
        _shape_for(first, have.end - have.start, want.end - want.start),
        dtype=first.tensor.dtype,
        device=first.tensor.device,
    )
    copied = sum(copy_heads(piece, out, want, want.num_heads) for piece in pieces)
    if copied != want.end - want.start:
        raise CorruptStateError(
            f"layer {first.layer_id} {first.kind.value}: the pieces hold {copied} of the "
            f"{want.end - want.start} heads [{want.start}, {want.end}) wanted"
        )
    state = LayerState(
        first.layer_id, first.kind, out, first.token_start, first.token_end, first.num_prompt_tokens
    )
    return _with_heads(state, want)


def whole_heads(states: Iterable[LayerState]) -> list[LayerState]:
    """`states` with the head-ranged pieces of each KDA (layer, kind, token range) assembled into
    every head, in the place of the first; MLA rows and whole states as they are (a reader that
    rebuilds the state itself: a stored resume, whose engine re-shards it on the way in)."""
    out: list[LayerState | list[LayerState]] = []
    groups: dict[tuple[int, StateKind, int, int], list[LayerState]] = {}
    for state in states:
        if state.heads is None:
            out.append(state)
            continue
        key = (state.layer_id, state.kind, state.token_start, state.token_end)
        if key not in groups:
            groups[key] = []
            out.append(groups[key])
        groups[key].append(state)
    return [s if isinstance(s, LayerState) else _every_head(s) for s in out]


def _every_head(pieces: list[LayerState]) -> LayerState:
    """Head-ranged pieces of one state assembled into all its heads."""
    heads = pieces[0].heads
    assert heads is not None
    return assemble(pieces, HeadRange(0, heads.num_heads, heads.num_heads))


def _with_heads(state: LayerState, heads: HeadRange) -> LayerState:
    """`state` naming `heads`, or no range when they are every head."""
    whole = heads.start == 0 and heads.end == heads.num_heads
    return dataclasses.replace(state, heads=None if whole else heads)


def take_heads(states: Iterable[LayerState], want: HeadRange) -> list[LayerState]:
    """A whole state's pieces (of any widths) as an engine holding heads `want` keeps them: every
    MLA piece as is, and per KDA layer and kind the piece that holds exactly `want` (not copied) or
    the overlap of the pieces that hold them (`assemble`). Raises CorruptStateError if a head is
    missing."""
    out: list[LayerState] = []
    groups: dict[tuple[int, StateKind], list[LayerState]] = {}
    for state in states:
        if state.kind is StateKind.MLA_KV:
            out.append(state)
        else:
            groups.setdefault((state.layer_id, StateKind(state.kind)), []).append(state)
    for pieces in groups.values():
        exact = [p for p in pieces if heads_of(p, want.num_heads) == want]
        out.append(exact[0] if exact else assemble(pieces, want))
    return out


def check_every_head(states: Iterable[LayerState], num_heads: int) -> None:
    """Raises CorruptStateError unless the KDA pieces of each layer and kind together hold every
    one of `num_heads` heads (each rank of any width finds its own there); moves no tensor."""
    held: dict[tuple[int, StateKind], list[HeadRange]] = {}
    for state in states:
        if state.kind is not StateKind.MLA_KV:
            held.setdefault((state.layer_id, StateKind(state.kind)), []).append(heads_of(state, num_heads))
    for (layer, kind), ranges in held.items():
        covered = 0
        for have in sorted(ranges):
            if have.num_heads != num_heads or have.start > covered:
                break
            covered = max(covered, have.end)
        if covered < num_heads:
            raise CorruptStateError(
                f"layer {layer} {kind.value}: the pieces hold heads {sorted(tuple(r) for r in ranges)}, "
                f"not every one of {num_heads}"
            )
