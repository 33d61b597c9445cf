"""Joining one engine's ranks into process groups, without torch.distributed's process-global state.

Rank 0 hosts a `TCPStore`; every rank builds its groups from it directly (no
`init_process_group`), so a process may hold several engines' groups over its life (tests start a
2-rank engine, end it, start a 4-rank one) and nothing global is left behind. The device group is
NCCL on CUDA and gloo on the CPU; the host group is always gloo.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from splitserve.engine.parallel.group import TensorParallel

# how long a collective may wait for a peer: a rank still loading its weights, or a long prefill on
# another rank; a peer that died is noticed sooner (its connections close)
COLLECTIVE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class StoreAddress:
    """Where rank 0's rendezvous store listens."""

    host: str
    port: int


def host_store(host: str, world_size: int) -> tuple[Any, StoreAddress]:
    """Rank 0's store on a free port of `host`, and its address for the other ranks."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
    return store, StoreAddress(host, store.port)


def join(
    address: StoreAddress,
    rank: int,
    world_size: int,
    device: torch.device,
    expert_parallel: bool,
    store: Any = None,
) -> TensorParallel:
    """This rank's `TensorParallel`, once every rank has joined (blocks until they have)."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if store is None:
        store = dist.TCPStore(address.host, address.port, world_size, is_master=False, timeout=timeout)
    host = _group(dist.PrefixStore("host", store), rank, world_size, torch.device("cpu"), timeout)
    on_device = host
    if device.type == "cuda":
        on_device = _group(dist.PrefixStore("device", store), rank, world_size, device, timeout)
    return TensorParallel(rank, world_size, expert_parallel, on_device, host)


def _group(store: Any, rank: int, size: int, device: torch.device, timeout: datetime.timedelta) -> Any:
    """A process group of one backend (gloo for the CPU, NCCL for CUDA) that is not registered
    globally; the collectives take it as `group=`."""
    from torch._C._distributed_c10d import ProcessGroup

    group = ProcessGroup(store, rank, size)
    if device.type == "cuda":  # not run on this project's CPU machines: NCCL needs GPUs
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend: Any = dist.ProcessGroupNCCL(store, rank, size, options)
        kind = ProcessGroup.BackendType.NCCL
    else:
        backend = dist.ProcessGroupGloo(store, rank, size, timeout)
        kind = ProcessGroup.BackendType.GLOO
    backend._set_sequence_number_for_group()
    group._set_default_backend(kind)
    group._register_backend(device, kind, backend)
    return group
