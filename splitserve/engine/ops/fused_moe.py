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
# paying for large prefill steps (the torch ops' sort scales better there).
ALIGN_KERNEL_MAX_WORK = 1 << 17


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


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """Same contract as `moe_experts_torch`: x [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]."""
    num_tokens, top_k = expert_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    sorted_pairs, block_expert = _align(expert_ids, num_experts, block_m)
    x = x.contiguous()
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _launch(x, w13, h, sorted_pairs, block_expert, num_pairs, inter, hidden, top_k, block_m, None)
    per_choice = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # rounded as the reference
    flat_weights = weights.reshape(-1).float().contiguous()
    _launch(h, w2, per_choice, sorted_pairs, block_expert, num_pairs, hidden, inter, 1, block_m, flat_weights)
    return per_choice.view(num_tokens, top_k, hidden).sum(dim=1)


def _launch(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    n: int,
    k: int,
    rows_per_a: int,
    block_m: int,
    pair_weights: torch.Tensor | None,
) -> None:
    """`out[p] = f(a[p // rows_per_a] @ w[e(p)].T)`; gated (w holds gate; up) when no weights given."""
    import triton

    from splitserve.engine.ops.fused_moe_triton import GROUPED_GEMM

    block_n, block_k = 64, 64
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    gated = pair_weights is None
    GROUPED_GEMM[grid](
        a,
        w,
        out,
        sorted_pairs,
        block_expert,
        out if pair_weights is None else pair_weights,
        num_pairs,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        ROWS_PER_A=rows_per_a,
        GATED=gated,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
