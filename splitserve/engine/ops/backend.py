"""The one rule every op with a kernel follows to pick its implementation.

The kernel runs on a CUDA device where its package imports; the torch reference runs
everywhere else. An environment variable (`SPLITSERVE_<OP>_BACKEND`) forces either one, for
benchmarks and debugging; forcing a kernel whose package is missing is an error naming the install.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def importable(package: str) -> bool:
    """Whether `package` can be imported here (kernel packages are optional on CPU nodes)."""
    return importlib.util.find_spec(package) is not None


def choose_backend(env: str, kernel: str, available: bool, install_hint: str, device: torch.device) -> str:
    """`kernel` on CUDA when `available`, else `"torch"`; `env` set to either name overrides."""
    forced = os.environ.get(env, "").strip().lower()
    if forced == kernel and not available:
        raise RuntimeError(f"{env}={kernel} but its package is not installed: {install_hint}")
    if forced in ("torch", kernel):
        return forced
    if forced:
        raise ValueError(f"{env}={forced!r}: expected 'torch' or '{kernel}' (or unset for automatic)")
    return kernel if device.type == "cuda" and available else "torch"
