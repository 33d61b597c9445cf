"""Which part of a full (unsharded) parameter one rank keeps, and where a checkpoint piece lands in it.

A `Shard` rides on the rank's parameter (`param.shard`, set by the layer that owns it); the loader
asks `placements` where each checkpoint tensor goes and reads only the slices the rank keeps
(safetensors reads a slice from the mapped file without materialising the rest). Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """A rank's cut of a parameter along `dim`: the full dimension is `parts` equal parts (2 for a
    fused gate; up), each split evenly over `num_ranks`; the rank keeps piece `rank` of every part,
    in part order. Heads, intermediate columns, vocabulary rows and experts are all cut this way."""

    dim: int
    rank: int
    num_ranks: int
    parts: int = 1

    def owned(self, local_size: int) -> list[tuple[int, int, int]]:
        """(full start, full stop, local start) of each run the rank keeps along `dim`, given the
        rank's own size of that dimension."""
        piece = local_size // self.parts
        part = piece * self.num_ranks
        return [
            (p * part + self.rank * piece, p * part + (self.rank + 1) * piece, p * piece)
            for p in range(self.parts)
        ]


Slices = tuple[slice, ...]


def placements(
    local_shape: Sequence[int], shard: Shard | None, offset: Sequence[int], size: Sequence[int]
) -> Iterator[tuple[Slices, Slices]]:
    """Where a piece covering `[offset[d], offset[d] + size[d])` of the full parameter in each dim
    goes in the rank's parameter of `local_shape`: (slices of the piece, slices of the parameter),
    one pair per run the rank keeps; nothing when the rank keeps none of it."""
    whole_src = [slice(0, n) for n in size]
    whole_dst = [slice(o, o + n) for o, n in zip(offset, size)]
    if shard is None:
        yield tuple(whole_src), tuple(whole_dst)
        return
    d = shard.dim
    start, stop = offset[d], offset[d] + size[d]
    for full_start, full_stop, local_start in shard.owned(local_shape[d]):
        lo, hi = max(start, full_start), min(stop, full_stop)
        if lo >= hi:
            continue
        src, dst = list(whole_src), list(whole_dst)
        src[d] = slice(lo - start, hi - start)
        dst[d] = slice(local_start + lo - full_start, local_start + hi - full_start)
        yield tuple(src), tuple(dst)


def set_shard(param: object, shard: Shard | None) -> None:
    """Mark `param` as cut by `shard` (nothing for a whole parameter): the loader reads the mark."""
    if shard is not None:
        param.shard = shard  # type: ignore[attr-defined]


def shard_of(param: object) -> Shard | None:
    return getattr(param, "shard", None)
