"""Counting kernel launches on the CPU: a dispatch mode that counts the aten ops that would launch a
kernel, stand-ins that count each Triton or fla launch, and the CUDA code path forced on a CPU.

Used by experiments/decode_launches.py (and its tests). Nothing here needs a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import os
import sys
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from splitserve.engine.ops import backend, fused_moe, kda_dispatch, paged_mla, replay_ssm, triton_kernel

# ops that allocate or relabel memory without a kernel
_NOT_LAUNCHES = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "detach",
    "detach_",
    "lift_fresh",
    "_unsafe_view",
}
RUNNER = "runner"  # ops outside the decoder layers: batch build, embedding, final norm, logits
SAMPLER = "sampler"


class LaunchCounter(TorchDispatchMode):
    """Counts each dispatched aten op that launches a kernel (not a view, not a bare allocation),
    and each stubbed Triton or fla launch (`launch`), under the innermost module running
    (`scope`: a module path such as `model.layers.3.self_attn`, or RUNNER / SAMPLER)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[str, str]] = Counter()  # (scope, op) -> launches
        self.launched: list[Launch] = []  # the stubbed Triton launches, in order
        self.fla_calls: list[tuple[str, tuple[Any, ...]]] = []  # fla calls: name, what its autotune keys read
        self.scopes: list[str] = []
        self.enabled = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "prim":  # prim.device and the like: metadata
            return func(*args, **kwargs)
        if _is_composite(func):  # under inference_mode composites reach the mode whole: count their parts
            with self:  # the mode is off while it dispatches: back on for the parts
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        name = func.overloadpacket.__name__
        if self.enabled and not func.is_view and name not in _NOT_LAUNCHES:
            self.launch(name)
        return func(*args, **kwargs)

    def launch(self, op: str) -> None:
        if self.enabled:
            self.counts[(self.scopes[-1] if self.scopes else RUNNER, op)] += 1

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self.scopes.append(name)
        try:
            yield
        finally:
            self.scopes.pop()

    def track_modules(self, model: torch.nn.Module) -> None:
        """Attribute ops to the module that runs them (functional calls to their caller)."""

        def enter(name: str) -> Any:
            return lambda module, args: self.scopes.append(name)  # returns None: args unchanged

        def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
            self.scopes.pop()

        for name, module in model.named_modules():
            if name:
                module.register_forward_pre_hook(enter(name))
                module.register_forward_hook(leave)


def _is_composite(func: Any) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


class CountedLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` counts one launch and keeps its arguments."""

    def __init__(self, counter: LaunchCounter, kernel: triton_kernel.TritonKernel) -> None:
        self.counter, self.kernel = counter, kernel

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.counter.launch(f"triton:{self.kernel.name}")
            self.counter.launched.append(Launch(self.kernel, args, kwargs, grid))

        return launch


@dataclasses.dataclass
class Launch:
    """One stubbed Triton launch: the kernel and what it was given (fake tensors, scalars, meta-parameters)."""

    kernel: triton_kernel.TritonKernel
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grid: Any = None


def _fla_stub(counter: LaunchCounter) -> dict[str, types.ModuleType]:
    """Modules standing in for fla's: its fused recurrent KDA step and its chunked KDA (prefill) each
    count one launch; `counter.fla_calls` keeps what their autotune keys read (batch, heads, dims, dtype)."""

    def fused_recurrent_kda_fwd(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kw: Any
    ) -> Any:
        counter.launch("fla:fused_recurrent_kda_fwd")
        counter.fla_calls.append(("fused_recurrent_kda_fwd", (*k.shape[2:], v.shape[-1], q.dtype)))
        return torch.empty_like(v), None

    def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kw: Any) -> Any:
        counter.launch("fla:chunk_kda")  # [B, L, H, D]: every key but the length L
        counter.fla_calls.append(("chunk_kda", (k.shape[0], *k.shape[2:], v.shape[-1], q.dtype)))
        state = kw["initial_state"]
        return torch.empty_like(v), torch.empty_like(state)

    names = ["fla", "fla.ops", "fla.ops.kda", "fla.ops.kda.fused_recurrent"]
    stubs = {}
    for name in names:
        stubs[name] = types.ModuleType(name)
        stubs[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
    stubs["fla.ops.kda.fused_recurrent"].fused_recurrent_kda_fwd = fused_recurrent_kda_fwd  # type: ignore[attr-defined]
    stubs["fla.ops.kda"].chunk_kda = chunk_kda  # type: ignore[attr-defined]
    return stubs


@contextlib.contextmanager
def cuda_code_path(counter: LaunchCounter) -> Iterator[None]:
    """Every backend choice made as on a CUDA device with triton and fla; every launch counted."""
    env = {
        env: "triton"
        for env in (paged_mla.BACKEND_ENV, fused_moe.BACKEND_ENV, triton_kernel.FUSED_BACKEND_ENV)
    }
    env[kda_dispatch.BACKEND_ENV] = "fla"
    env[replay_ssm.BACKEND_ENV] = "triton"
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, env))
        stack.enter_context(mock.patch.dict(sys.modules, _fla_stub(counter)))
        backend.importable.cache_clear()  # fla is importable now, and not after
        stack.callback(backend.importable.cache_clear)
        stack.enter_context(triton_kernel.stand_in(lambda kernel: CountedLaunch(counter, kernel)))
        yield


def runner_copy(counter: LaunchCounter) -> Any:
    """`HostPack.to` that counts its copy as one launch and starts counting the device ops after it."""
    from splitserve.engine.host_pack import HostPack

    original = HostPack.to

    def to(self: HostPack, device: torch.device) -> None:
        original(self, device)
        counter.enabled = True
        counter.launch("host_to_device_copy")

    return to


@contextlib.contextmanager
def count_host_reads(counter: LaunchCounter) -> Iterator[None]:
    """Each tensor the sampler sends to the host (`HostReadback`: one non-blocking copy each on CUDA,
    none on a CPU) counted as one device-to-host copy."""
    from splitserve.engine.sampler_output import HostReadback

    original = HostReadback.__init__

    def counted(self: HostReadback, tensors: list[torch.Tensor]) -> None:
        for _ in tensors:
            counter.launch("device_to_host_copy")
        original(self, tensors)

    with mock.patch.object(HostReadback, "__init__", counted):
        yield
