"""Every Triton kernel a decode step launches builds for an H100/H200 (sm_90) from this CPU: triton
lowers each one, with the argument types and meta-parameters of its launch in a 1B-shaped and a
48B-shaped decode step, through to a cubin (triton ships ptxas). Nothing runs: the interpreter
tests check what the kernels compute; this checks what the interpreter cannot (types that must
agree across branches, what the GPU backend lowers), so a kernel does not first fail to build on a
GPU machine. The installed triton may differ from a GPU machine's."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

from experiments import decode_launches, launch_counter  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
_POINTER = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int8: "*i8",
    torch.bool: "*i1",
}
_OPTIONS = ("num_warps", "num_stages")


def signature(launch: launch_counter.Launch) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """The launch as triton's JIT would see it: parameter types, constexprs, compile options."""
    import triton

    names = list(inspect.signature(launch.kernel.fn).parameters)
    types: dict[str, str] = {}
    constants: dict[str, Any] = {}
    for name, value in zip(names, launch.args):
        if isinstance(value, torch.Tensor):
            types[name] = _POINTER[value.dtype]
        elif isinstance(value, bool) or value == 1 and isinstance(value, int):  # triton specialises ints of 1
            types[name], constants[name] = "constexpr", value
        elif isinstance(value, int):
            types[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            types[name] = "fp32"
        else:
            raise AssertionError(f"{launch.kernel.name}: {name}={value!r} has no triton type here")
    for name, value in launch.kwargs.items():
        if name not in _OPTIONS:
            types[name], constants[name] = "constexpr", value
    assert set(types) == set(names), f"{launch.kernel.name}: parameters {set(names) - set(types)} not given"
    options = {name: launch.kwargs[name] for name in _OPTIONS if name in launch.kwargs}
    assert triton is not None
    return types, constants, options


@pytest.mark.parametrize(("model", "batch_size"), [("1b", 1), ("1b", 64), ("48b", 1), ("48b", 64)])
def test_every_decode_kernel_builds_for_sm90(model, batch_size):
    step = decode_launches.count_decode_step(decode_launches.model_config(model), batch_size, context=300)
    built = set()
    for launch in step.launched:
        types, constants, options = signature(launch)
        key = (launch.kernel.name, tuple(sorted(types.items())), tuple(sorted(map(str, constants.items()))))
        if key in built:
            continue
        import triton

        source = ASTSource(triton.jit(launch.kernel.fn), types, constexprs=constants)
        binary = compile(source, target=H200, options=options)
        assert binary.asm["cubin"], launch.kernel.name
        built.add(key)
    names = {key[0] for key in built}
    assert {"rms_norm", "kda_decode_gates", "gated_rms_norm", "moe_router", "moe_align"} <= names
    assert {"moe_grouped_gemm", "paged_mla", "paged_mla_merge", "mla_write_kv"} <= names
