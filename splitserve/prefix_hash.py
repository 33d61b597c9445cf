"""Names of prompt prefixes: a chain of hashes, one per `prefix_unit` tokens, each covering all before it.

The gateway computes the chain once per request and sends it along; engines, stores and the
router compare prefixes only by these names. `chain[i]` names tokens `0 .. (i + 1) * unit`, so two
prompts share their first `n` units exactly when their chains agree at element `n - 1` (up to a
128-bit hash collision). Only whole units are named; a prefix ending inside a unit is named by
`extend(chain[j - 1], tail)`, which is what an engine stores a prompt end under.

`salt` separates models (and checkpoints) that must never share state: one cluster serves one
model, so its served model name is the usual salt. Torch-free.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

import xxhash

HASH_BYTES = 16  # XXH3-128: a collision among even 2**40 stored prefixes is ~1e-15 likely

_LITTLE = sys.byteorder == "little"


def root(salt: bytes = b"") -> bytes:
    """The name of the empty prefix (what the first unit extends)."""
    return xxhash.xxh3_128_digest(b"splitserve-prefix-v1:" + salt)


def extend(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The name of the prefix named `parent` followed by `token_ids`."""
    tokens = array.array("i", token_ids)  # int32: every vocabulary fits, and the bytes are fixed-width
    if not _LITTLE:
        tokens.byteswap()
    return xxhash.xxh3_128_digest(parent + tokens.tobytes())


def prefix_hash_chain(token_ids: Sequence[int], unit: int, salt: bytes = b"") -> list[bytes]:
    """One name per whole `unit` of `token_ids` (a trailing partial unit is not named)."""
    return grow_chain([], token_ids, unit, salt)


def grow_chain(chain: Sequence[bytes], token_ids: Sequence[int], unit: int, salt: bytes = b"") -> list[bytes]:
    """`chain` (the names of the first `len(chain)` units of `token_ids`) grown to name every
    whole unit of `token_ids`: a prompt's chain extended over the reply, hashing only the rest."""
    if unit < 1:
        raise ValueError(f"prefix unit must be at least 1 token (got {unit})")
    grown = list(chain)
    parent = grown[-1] if grown else root(salt)
    for start in range(len(grown) * unit, len(token_ids) - unit + 1, unit):
        parent = extend(parent, token_ids[start : start + unit])
        grown.append(parent)
    return grown
