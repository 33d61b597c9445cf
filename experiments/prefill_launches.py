"""Kernel launches of one prefill chunk on the CUDA code path, counted on this CPU, with their grids.

    python -m experiments.prefill_launches [--model 1b|48b|tiny] [--chunk 2048] [--contexts 0,30720]

The model is built with fake weights and every launch stubbed as in experiments/decode_launches.py;
one chunk of `--chunk` prompt tokens runs after `context` tokens already in the caches (the runner's
batch build, the forward; the chunk samples nothing). Printed per context: launches per chunk, and
the largest grid a launch asked for on each axis (CUDA takes up to 2^31 - 1 programs on the first
axis, 65,535 on the others: a launch past that fails, and its op falls back to its torch reference
for the rest of the process, ops/triton_kernel.py). Nothing here needs a GPU.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.decode_launches import BLOCK_SIZE, GREEDY, StepCount, build_fake_model, model_config
from experiments.launch_counter import Launch, LaunchCounter, cuda_code_path, runner_copy
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import ScheduledRequest

CUDA_GRID_LIMITS = (2**31 - 1, 65_535, 65_535)


def count_prefill_chunk(config: KimiLinearModelConfig, context: int, chunk: int) -> StepCount:
    """Launches of one `chunk`-token prompt chunk after `context` computed tokens, CUDA code path."""
    counter = LaunchCounter()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with cuda_code_path(counter), torch.inference_mode():
        with fake:
            model, caches = build_fake_model(config, 1, context + chunk)
        counter.track_modules(model)
        runner = ModelRunner(model, caches, Sampler(1, ()), BLOCK_SIZE, torch.device("cpu"))
        end = context + chunk
        request = Request("prompt", [1 + j % 100 for j in range(end + 1)], GREEDY, 1, 0)
        request.num_computed_tokens, request.state_slot = context, 0
        request.block_table = list(range(-(-end // BLOCK_SIZE)))
        with mock.patch("splitserve.engine.host_pack.HostPack.to", runner_copy(counter)), counter:
            batch = runner.build_batch([], [ScheduledRequest(request, chunk)])
        with fake, counter:
            model(batch, caches)
    counter.enabled = False
    return StepCount(config, 1, counter.counts, counter.launched)


def largest_grid(step: StepCount) -> tuple[int, int, int]:
    """The largest number of programs any launch of `step` asked for, per grid axis."""
    most = [1, 1, 1]
    for launch in step.launched:
        grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        most = [max(m, int(g)) for m, g in zip(most, grid)]
    return most[0], most[1], most[2]


def compile_key(launch: Launch) -> tuple[Any, ...]:
    """What Triton compiles a launch's binary for: the kernel, each argument's type (tensors by dtype;
    integers as 1, a multiple of 16, or neither, unless the kernel leaves them unspecialised; 32 or
    64 bits) and the meta-parameters."""
    names = list(inspect.signature(launch.kernel.fn).parameters)

    def spec(name: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return str(value.dtype)
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, int):
            width = "" if -(2**31) <= value < 2**31 else "64"
            if name in getattr(launch.kernel, "do_not_specialize", ()):
                return "int" + width
            return ("1" if value == 1 else ("D" if value % 16 == 0 else "i")) + width
        return type(value).__name__

    args = tuple(spec(name, value) for name, value in zip(names, launch.args))
    return (launch.kernel.name, args, tuple(sorted(launch.kwargs.items())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1b", choices=["1b", "48b", "tiny"])
    parser.add_argument("--chunk", type=int, default=2048, help="prompt tokens in the chunk")
    parser.add_argument("--contexts", default="0,30720", help="comma-separated tokens before the chunk")
    args = parser.parse_args(argv)
    config = model_config(args.model)
    for context in (int(c) for c in args.contexts.split(",")):
        step = count_prefill_chunk(config, context, args.chunk)
        grid = largest_grid(step)
        fits = all(g <= limit for g, limit in zip(grid, CUDA_GRID_LIMITS))
        print(
            f"model {args.model}, chunk {args.chunk:,} after {context:,} tokens: {step.total:,} launches "
            f"({sum(step.per_layer()):,} in the layers); largest grid {grid} "
            f"({'fits' if fits else 'PAST'} CUDA's limits {CUDA_GRID_LIMITS})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
