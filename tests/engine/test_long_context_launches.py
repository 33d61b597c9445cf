"""Long prompts on the CUDA code path, counted on the CPU (experiments/prefill_launches.py): a prefill
chunk launches the same kernels, compiled for the same specialisations, whatever context precedes it,
and so does a decode step (a request deep into a long prompt compiles nothing new); every launch of
a very long chunk fits CUDA's grid (a launch past it fails, and its op would fall back to torch for
the rest of the process)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")  # the kernels' Python wrappers import it

from experiments import decode_launches, prefill_launches  # noqa: E402
from experiments.prefill_launches import CUDA_GRID_LIMITS, compile_key  # noqa: E402


def _compiled(step: decode_launches.StepCount) -> set[tuple[object, ...]]:
    """The binaries Triton would build for a step's launches."""
    return {compile_key(launch) for launch in step.launched}


def test_a_prefill_chunk_launches_and_compiles_the_same_whatever_context_precedes_it():
    config = decode_launches.model_config("tiny")
    first = prefill_launches.count_prefill_chunk(config, context=0, chunk=64)
    deep = prefill_launches.count_prefill_chunk(config, context=3_000, chunk=64)
    assert deep.total == first.total
    assert _compiled(deep) == _compiled(first)


def test_a_decode_step_compiles_the_same_kernels_at_a_short_and_a_long_context():
    # the attention's context splits grow with the context (flash-decoding): they must not reach
    # the kernels' compiled specialisations
    config = decode_launches.model_config("tiny")
    short = decode_launches.count_decode_step(config, batch_size=1, context=100)
    long = decode_launches.count_decode_step(config, batch_size=1, context=30_000)
    assert _compiled(long) == _compiled(short)


def test_every_launch_of_a_70k_token_chunk_fits_cudas_grid():
    # 1B shape, 16 heads: the paged MLA kernel has one program per 16 (token, head) pairs, so 70,000
    # of them, past the 65,535 that a grid's second and third axes take
    step = prefill_launches.count_prefill_chunk(decode_launches.model_config("1b"), context=0, chunk=70_000)
    grid = prefill_launches.largest_grid(step)
    assert grid[0] >= 70_000  # the kernels did launch at that size
    assert all(g <= limit for g, limit in zip(grid, CUDA_GRID_LIMITS)), grid
