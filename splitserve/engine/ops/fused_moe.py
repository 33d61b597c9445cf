"""Fused MoE in Triton: the CUDA path of the routed experts (torch reference: ops/moe_reference.py).

The (token, choice) pairs are sorted by expert on the device, each expert's run padded to a
multiple of `BLOCK_M`, so every block of rows belongs to one expert. One grouped-GEMM kernel
then runs twice: `silu(x w1) * (x w3)` into an [P, I] buffer (gate and up tiles in the same
program), then `h w2` times the routing weight into [P, H]; a token's `k` rows are summed last.
The launch grid is sized from the upper bound on padded rows, so nothing waits for the host
(blocks past the end exit at once) and the whole call can be captured in a CUDA graph.

The kernels live in ops/fused_moe_triton.py, imported only when one is first used: a node without
triton runs the torch path. Set `TRITON_INTERPRET=1` before the first import to run them on CPU
tensors (tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from splitserve.engine.ops.backend import choose_backend
from splitserve.engine.ops.triton_kernel import kernel_or_torch

BACKEND_ENV = "SPLITSERVE_MOE_BACKEND"


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here (CUDA builds of torch bring it; `splitserve[engine]` on Linux)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def moe_backend(device: torch.device) -> str:
    """`triton` on a CUDA device with triton installed, else `torch`; the env var overrides."""
    return choose_backend(BACKEND_ENV, "triton", triton_available(), "pip install triton", device)


def align_by_expert(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids sorted by expert, each expert's run padded to `block_m`, and each block's expert.

    Returns `sorted_pairs` [num_blocks * block_m] (pair `p = t * k + j`; padding holds `P`,
    the number of pairs) and `block_expert` [num_blocks] (-1 for blocks past the last run).
    `num_blocks` depends only on the shapes, never on the routing.
    """
    flat = expert_ids.reshape(-1)
    num_pairs, dev = flat.numel(), flat.device
    # not bincount: on CUDA it reads the largest id back to the host to size its output
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=dev) - (counts.cumsum(0) - counts)[sorted_experts]
    num_blocks = -(-(num_pairs + num_experts * (block_m - 1)) // block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.long, device=dev)
    sorted_pairs[(run_ends - padded)[sorted_experts] + rank] = order
    block_starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(run_ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert


# `fused_moe` aligns with one Triton launch instead of ~20 torch ops (each a launch, ~50 us of host
# time eagerly and a few us of device time in a graph) while pairs x experts (rounded up to a power of
# two) stays under this: each of its programs compares every pair with every expert, which stops
# paying for large prefill steps (the torch ops' sort scales better there). 2^20 covers decode of
# Kimi-Linear-48B (256 experts top-8 and a shared one: 512 x 9 per token) up to ~220 rows; at the
# limit all programs together make ~0.5 G compares, ~10 us on an H200 by arithmetic (not measured).
ALIGN_KERNEL_MAX_WORK = 1 << 20


def align_by_expert_triton(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s exact result from one launch (one program per expert: it counts every
    expert's pairs, so it knows where its padded run starts, then writes its pairs in order, its
    padding and its blocks' expert id; the last one also marks the blocks past every run empty); no
    host sync, so a CUDA graph can hold it."""
    import triton

    flat = expert_ids.reshape(-1).contiguous()
    num_pairs, dev = flat.numel(), flat.device
    num_blocks = -(-(num_pairs + num_experts * (block_m - 1)) // block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.long, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.long, device=dev)
    block_e = triton.next_power_of_2(num_experts)
    from splitserve.engine.ops.fused_moe_triton import ALIGN

    ALIGN[(num_experts,)](
        flat,
        sorted_pairs,
        block_expert,
        num_pairs,
        num_blocks,
        BLOCK_M=block_m,
        BLOCK_P=max(16, 8192 // block_e),
        BLOCK_E=block_e,
    )
    return sorted_pairs, block_expert


def _align(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton alignment for small calls, the torch one otherwise or once the kernel failed to build."""
    work = expert_ids.numel() * (1 << (num_experts - 1).bit_length())
    if work <= ALIGN_KERNEL_MAX_WORK:
        return kernel_or_torch(
            "moe_align",
            lambda: align_by_expert_triton(expert_ids, num_experts, block_m),
            lambda: align_by_expert(expert_ids, num_experts, block_m),
        )
    return align_by_expert(expert_ids, num_experts, block_m)


@dataclass(frozen=True)
class SharedExperts:
    """A layer's always-on shared MLP, run by the routed experts' kernels as `num` extra experts of the
    routed intermediate size: `gate_up` [2 * num * I, H] (gate rows, then up rows) and `down` [H, num * I].
    Shared expert `j` is intermediate slice `j` (a SwiGLU MLP is the sum of its slices' MLPs)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    num: int


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    shared: SharedExperts | None = None,
    *,
    some_elsewhere: bool = False,
) -> torch.Tensor:
    """Same contract as `moe_experts_torch`: x [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]. With
    `shared`, ids E.. E + shared.num - 1 name the shared experts (the router appends them, weight 1):
    the shared MLP and the routed experts then cost the same launches as the routed ones alone.
    `some_elsewhere` (expert parallelism): id E + shared.num names an expert on another rank; its
    choices add nothing here (their blocks are skipped and their rows stay zero)."""
    num_tokens, top_k = expert_ids.shape
    num_routed, two_i, hidden = w13.shape
    inter = two_i // 2
    num_experts = num_routed + (shared.num if shared is not None else 0)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    sorted_pairs, block_expert = _align(expert_ids, num_experts + int(some_elsewhere), block_m)
    if some_elsewhere:  # the last run's blocks are the other ranks' choices: no program computes them
        block_expert = block_expert.masked_fill(block_expert == num_experts, -1)
    x = x.contiguous()
    plan = _Plan(sorted_pairs, block_expert, num_pairs, num_routed, block_m)
    shared_w13 = shared_w2 = None
    if shared is not None:  # slice j: gate rows j*I.. (its up rows num*I further), down columns j*I..
        row = shared.gate_up.stride(0)
        shared_w13 = _SharedSlices(shared.gate_up, inter * row, shared.num * inter * row)
        shared_w2 = _SharedSlices(shared.down, inter, 0)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _launch(x, w13, h, plan, inter, hidden, top_k, None, shared_w13)
    alloc = torch.zeros if some_elsewhere else torch.empty  # skipped choices must read as zero
    per_choice = alloc(num_pairs, hidden, dtype=x.dtype, device=x.device)  # rounded as the reference
    flat_weights = weights.reshape(-1).float().contiguous()
    _launch(h, w2, per_choice, plan, hidden, inter, 1, flat_weights, shared_w2)
    return per_choice.view(num_tokens, top_k, hidden).sum(dim=1)


@dataclass(frozen=True)
class _Plan:
    """A call's pairs aligned by expert, and how many of its experts are routed."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_pairs: int
    num_routed: int
    block_m: int


@dataclass(frozen=True)
class _SharedSlices:
    """Where shared expert `j`'s weights start (`weight` + j * step) and its up rows (+ up, gated only)."""

    weight: torch.Tensor
    step: int
    up: int


def _launch(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    plan: _Plan,
    n: int,
    k: int,
    rows_per_a: int,
    pair_weights: torch.Tensor | None,
    shared: _SharedSlices | None,
) -> None:
    """`out[p] = f(a[p // rows_per_a] @ w[e(p)].T)`; gated (w holds gate; up) when no weights given."""
    import triton

    from splitserve.engine.ops.fused_moe_triton import GROUPED_GEMM

    assert w.stride(2) == 1 and (shared is None or shared.weight.stride(1) == 1)
    block_n, block_k = 64, 64
    grid = (plan.block_expert.numel(), triton.cdiv(n, block_n))
    GROUPED_GEMM[grid](
        a,
        w,
        w if shared is None else shared.weight,
        out,
        plan.sorted_pairs,
        plan.block_expert,
        out if pair_weights is None else pair_weights,
        plan.num_pairs,
        plan.num_routed,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        0 if shared is None else shared.step,
        w.stride(1) if shared is None else shared.weight.stride(0),
        0 if shared is None else shared.up,
        out.stride(0),
        ROWS_PER_A=rows_per_a,
        GATED=pair_weights is None,
        BLOCK_M=plan.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4,
    )


def warm_up(
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    shared: SharedExperts | None,
    num_rows: int,
    some_elsewhere: bool = False,
) -> None:
    """Launch the alignment and both grouped GEMMs once for `num_rows` tokens with these experts (each
    token on experts 0..k-1, or as many as there are, and the shared ones), at the block size that
    many rows take."""
    num_routed, hidden, dev = w13.shape[0], w13.shape[2], w13.device
    num_shared = shared.num if shared is not None else 0
    ids = torch.cat([torch.arange(top_k) % num_routed, num_routed + torch.arange(num_shared)]).to(dev)
    ids = ids.expand(num_rows, -1).contiguous()
    weights = torch.ones(ids.shape, device=dev)
    x = torch.zeros(num_rows, hidden, dtype=w13.dtype, device=dev)
    fused_moe(x, w13, w2, weights, ids, shared, some_elsewhere=some_elsewhere)
