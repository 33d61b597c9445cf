"""The memory of the device a worker would run on here: the first visible GPU, or the host's RAM.

Torch-free where it can be: a GPU is asked through `nvidia-smi` (present wherever the driver
is), then through torch if it is installed; a machine with neither has no visible GPU (None).
Used by the memory plan when a pool's config does not give `device_memory_bytes`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

_NVIDIA_SMI_TIMEOUT_S = 10.0


def visible_gpu_memory_bytes() -> int | None:
    """Total memory of the first GPU this process may use (CUDA_VISIBLE_DEVICES), or None."""
    found = _nvidia_smi_total_bytes()
    return found if found is not None else _torch_total_bytes()


def host_memory_bytes() -> int:
    """This machine's physical RAM: a CPU worker's device."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def _first_visible_gpu() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def _nvidia_smi_total_bytes() -> int | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", _first_visible_gpu()]
    try:
        done = subprocess.run(
            query, capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = done.stdout.strip().splitlines()[:1]
    if done.returncode != 0 or not first or not first[0].strip().isdigit():
        return None
    return int(first[0].strip()) * 2**20  # nvidia-smi reports MiB


def _torch_total_bytes() -> int | None:
    if importlib.util.find_spec("torch") is None:  # a head node's base install has no torch
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)
