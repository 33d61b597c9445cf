"""Byte sizes in the config: an int, or a string with a unit ("2GiB", "512MiB", "1.5GB").

`ByteSize` is the field type: an int in Python, written back in the shortest exact binary unit
when a config is dumped to YAML or JSON, so files round-trip.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: object) -> int:
    """Parse a byte size: an int, or a string like "2GiB", "512MiB", "1.5GB", "4096"."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a byte size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative (got {value})")
        return value
    if isinstance(value, str):
        match = _BYTES_RE.match(value)
        unit = match.group(2).lower() if match else ""
        if match and unit in _UNITS:
            try:
                amount = Decimal(match.group(1)) * _UNITS[unit]
            except InvalidOperation:  # pragma: no cover - the regex admits only decimals
                amount = Decimal("NaN")
            if amount == amount.to_integral_value():
                return int(amount)
            raise ValueError(f"{value!r} is not a whole number of bytes")
    raise ValueError(
        f"{value!r} is not a byte size; write an integer or a number with a unit "
        "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 2GiB, 512MiB, 1.5GB"
    )


def format_bytes(num_bytes: int) -> str | int:
    """The shortest exact binary-unit spelling ("2GiB"), or the int itself where none is exact."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return num_bytes


# An int in Python; written back as "2GiB" when dumped to YAML/JSON, so files round-trip.
ByteSize = Annotated[int, BeforeValidator(parse_bytes), PlainSerializer(format_bytes, when_used="json")]
