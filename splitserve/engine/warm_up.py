"""Compile, autotune and capture while the engine loads, never inside a request.

`warm_up_engine(engine, load_start_s)` runs at the end of `LLMEngine.__init__`, so `LLM()` returns
and prefill, decode and colocated workers report healthy only once it is done. Where a kernel
compiles (a CUDA device, triton and fla; `kernels_compile`) it:

1. launches the decode step's Triton kernels once per CUDA-graph bucket (engine/model/warm_up.py);
2. runs dummy steps through the runner (`warm_up_steps`): a chunk of `max_num_batched_tokens` and
   chunks of 1024, 128 and 16 tokens (the ones below it), each also one token shorter, a decode row,
   a decode row beside a short prompt (a mixed step), and two short prompts in one step. Triton
   compiles one binary per class of each integer argument (equal to 1, a multiple of 16, or neither)
   and the fused MoE picks its block size and alignment by the number of pairs, all of which follow
   the tokens in a step; the attention kernels take context widths unspecialised
   (ops/paged_mla_triton.py), and fla's chunk kernels do not specialise on the length and autotune
   on keys without it, except its cumsum's batch size (prompts per step): 1 and 2 are tuned here, a
   step of 3 or more prompts still tunes it once, inside that step (fla's varlen call would not);
3. reports the decode CUDA graphs' capture, which the runner did at construction (engine/cuda_graph.py).

Every dummy row computes into one state slot and one KV block (all its positions map to the block's
rows): the scratch pair when the engine pads decode batches, else slot 0 and block 0, which no
request holds yet. Both are zeroed after, so every cache is as the allocators left it. Only the
decode step samples, greedily, so the sampler's generators are never drawn from. The load log gets one line with each
part's seconds. On a CPU nothing compiles and it returns at once.

`use_kernel_caches(device)` points `TRITON_CACHE_DIR` at `<splitserve cache>/triton` (unless set):
Triton keeps each compiled kernel there, and the autotune results of fla's kernels (fla sets
`cache_results`; `TRITON_CACHE_AUTOTUNING=1`, also set unless set, does it for other autotuners),
so a worker restarted on the same node loads them instead of compiling and benchmarking again.
Nothing here uses torch.compile, so TorchInductor's cache is not involved.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from splitserve.engine.cuda_graph_plan import batch_sizes
from splitserve.engine.request import Request
from splitserve.engine.scheduler import ScheduledRequest
from splitserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

CACHE_ENV = {"TRITON_CACHE_DIR": "triton", "TRITON_CACHE_AUTOTUNING": None}
# tokens of a step (and one fewer) at several scales, so a step of any size finds its classes compiled:
# the MoE picks a small block under 16 pairs per expert and its torch alignment past 2^20 pairs x experts
_STEP_TOKENS = (1024, 128, 16)
_SHORT = (16, 15)  # two short prompts: a multiple of 16 and not, both under the MoE's small-block limit


@dataclass
class WarmUpReport:
    """What the load did, in seconds: the weights and caches, then each warm-up part."""

    load_s: float = 0.0  # weights, cache allocation and (inside the runner) the graph capture
    decode_kernels_s: float = 0.0
    prefill_s: float = 0.0
    graphs_s: float = 0.0  # the decode CUDA graphs' capture (part of load_s: the runner captures)
    decode_batch_sizes: list[int] = field(default_factory=list)
    chunk_lengths: list[int] = field(default_factory=list)  # the dummy rows' lengths, in order
    decode_kernels: list[str] = field(default_factory=list)  # engine/model/warm_up.py's list
    num_graphs: int = 0

    @property
    def total_s(self) -> float:
        return self.load_s + self.decode_kernels_s + self.prefill_s

    def log_line(self) -> str:
        return (
            f"engine ready in {self.total_s:.1f} s: weights and caches {self.load_s - self.graphs_s:.1f} s, "
            f"{self.num_graphs} decode CUDA graphs {self.graphs_s:.1f} s, decode kernels "
            f"{self.decode_kernels_s:.1f} s (batch sizes {self.decode_batch_sizes}), prefill kernels "
            f"{self.prefill_s:.1f} s (rows of {self.chunk_lengths} tokens)"
        )


def use_kernel_caches(device: torch.device) -> dict[str, str]:
    """On CUDA, set the kernel cache variables the user has not set (see the module doc); returns
    what it set. Call before anything compiles: Triton reads them at each compile."""
    if device.type != "cuda":
        return {}
    from splitserve.default_model import cache_dir

    chosen = {}
    for name, folder in CACHE_ENV.items():
        if name not in os.environ:
            chosen[name] = str(cache_dir() / folder) if folder else "1"
    os.environ.update(chosen)
    return chosen


def kernels_compile(device: torch.device) -> bool:
    """Whether any op of this engine runs a kernel that compiles (Triton or fla) on `device`: only on
    CUDA (elsewhere a kernel forced on runs interpreted, or stubbed, and compiles nothing)."""
    if device.type != "cuda":
        return False
    from splitserve.engine.ops.fused_moe import moe_backend
    from splitserve.engine.ops.kda_dispatch import kda_backend
    from splitserve.engine.ops.paged_mla import mla_backend
    from splitserve.engine.ops.triton_kernel import fused_backend

    return (
        mla_backend(device) == "triton"
        or kda_backend(device) == "fla"
        or moe_backend(device) == "triton"
        or fused_backend(device) == "triton"
    )


def warm_up_engine(engine: LLMEngine, load_start_s: float, force: bool = False) -> WarmUpReport:
    """Warm a freshly built engine (see the module doc); `force` runs the dummy rows even where nothing
    compiles (the CPU tests of what they leave behind). Logs and returns what each part took."""
    graphs = engine.runner.graphs
    report = WarmUpReport(
        load_s=time.monotonic() - load_start_s,
        graphs_s=graphs.capture_s if graphs is not None else 0.0,
        num_graphs=len(graphs.graphs) if graphs is not None else 0,
    )
    if not (force or kernels_compile(engine.device)):
        return report
    from splitserve.engine.model.warm_up import warm_up_decode_kernels

    sizes = engine.padding.batch_sizes if engine.padding is not None else batch_sizes(engine.config)
    start_s = time.monotonic()
    report.decode_kernels = warm_up_decode_kernels(engine.model, sizes)
    report.decode_batch_sizes = list(sizes)
    _synchronize(engine.device)
    report.decode_kernels_s = time.monotonic() - start_s
    start_s = time.monotonic()
    report.chunk_lengths = _run_dummy_steps(engine)
    report.prefill_s = time.monotonic() - start_s
    logger.info("%s", report.log_line())
    return report


def warm_up_steps(engine: LLMEngine) -> list[list[tuple[int, int]]]:
    """The dummy steps: per step, its rows as (tokens already computed, new tokens)."""
    full = max(2, min(engine.config.max_num_batched_tokens, engine.max_model_len - 3))
    steps = []
    for length in sorted({full, *(n for n in _STEP_TOKENS if n < full)}, reverse=True):
        steps += [[(0, length)], [(0, length - 1)]]  # a multiple of 16 (or the budget) and not
    at = min(full, engine.max_model_len - 3)  # a decode row's context
    steps.append([(at, 1)])
    short = [n for n in _SHORT if n < full]
    if short:
        steps.append([(at, 1), (0, short[-1])])  # a mixed step: a decode row beside a prompt chunk
        steps.append([(0, n) for n in short])  # two prompts in one step (fla's cumsum tunes per batch)
    return steps


def _run_dummy_steps(engine: LLMEngine) -> list[int]:
    """Run `warm_up_steps` through the runner on one lent slot and block, then zero both."""
    slot, block = _lent_slot_and_block(engine)
    block_size = engine.config.block_size
    lengths: list[int] = []
    try:
        for rows in warm_up_steps(engine):
            scheduled = []
            for computed, num_new in rows:
                end = computed + num_new
                # the decode step alone samples (the logits and a greedy pick: no generator drawn
                # from); other rows end two tokens short of their prompt, so they sample nothing
                samples = len(rows) == 1 and num_new == 1
                ids = [0] * (end if samples else end + 2)
                request = Request("__warm_up__", ids, SamplingParams(temperature=0, max_tokens=1), 1, -1)
                request.num_computed_tokens, request.state_slot = computed, slot
                request.block_table = [block] * -(-end // block_size)  # every position in one block
                scheduled.append(ScheduledRequest(request, num_new))
                lengths.append(num_new)
            engine.runner.execute(scheduled)
        _synchronize(engine.device)
    finally:
        _zero(engine, slot, block)
    return lengths


def _lent_slot_and_block(engine: LLMEngine) -> tuple[int, int]:
    """The scratch slot and block when the engine has them (no allocator hands them out), else slot 0
    and block 0, which must still be free (the warm-up runs before any request)."""
    if engine.padding is not None:
        return engine.padding.scratch_slot, engine.padding.scratch_block
    scheduler = engine.scheduler
    held = (
        scheduler.slots.num_free_slots != engine.plan.num_slots
        or scheduler.blocks.num_free_blocks != engine.plan.num_blocks
    )
    if held:
        raise RuntimeError("the warm-up lends slot 0 and block 0: run it before the engine takes requests")
    return 0, 0


def _zero(engine: LLMEngine, slot: int, block: int) -> None:
    """Give back the lent slot and block as the allocators hand them out: zeros, no ReplaySSM records."""
    caches, rows = engine.caches, engine.config.block_size
    for kv in caches.mla_kv.values():
        kv[block * rows : (block + 1) * rows].zero_()
    for state in (*caches.kda_conv.values(), *caches.kda_recurrent.values()):
        state[slot].zero_()
    if caches.replay is not None:
        caches.replay.reset(slot)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
