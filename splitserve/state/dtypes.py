"""The one table of dtypes state can travel in: torch's name (without "torch.") -> bytes per element.

Torch-free, so the store can size and check chunks without torch; the engine turns a name into
a torch dtype with `getattr(torch, name)`.
"""

from __future__ import annotations

DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
