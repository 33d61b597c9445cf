"""Which KDA implementation runs: flash-linear-attention's kernels on CUDA, the torch reference elsewhere.

`kda_prefill` and `kda_decode` have exactly the contracts of `kda_chunked` and
`kda_recurrent_step` (splitserve/engine/ops/kda.py, the CPU reference): q and k arrive
L2-normalised with q already scaled (so fla gets `scale=1` and no in-kernel norm or gate), the
state is fp32 [N, H, Dk, Dv], and the state returned is the fp32 state after the last token.
fla keeps its per-chunk intermediate states in the input dtype (bf16 in a bf16 model); we never
read those: every call asks for fla's fp32 final state, so a call boundary (a chunk the
scheduler ends, a snapshot for transfer) always takes an exact fp32 state.

fla (`pip install 'splitserve[gpu]'`, package `fla-core`) runs only on CUDA, not on the CPU or
under the Triton interpreter. `SPLITSERVE_KDA_BACKEND=torch|fla` overrides the automatic choice.
A CUDA device without fla is refused (the engine checks at load) unless that variable says
`torch`: the torch reference's KDA prefill measured 36.7x slower than fla's on an H200
(docs/PERFORMANCE.md section 5), too slow to be a silent fallback.
"""

from __future__ import annotations

import os

import torch

from splitserve.engine.ops.backend import choose_backend, importable
from splitserve.engine.ops.kda import kda_chunked, kda_chunked_varlen, kda_recurrent_step, kda_recurrent_step_

BACKEND_ENV = "SPLITSERVE_KDA_BACKEND"
INSTALL_HINT = "pip install 'splitserve[gpu]'"


def fla_available() -> bool:
    """Whether flash-linear-attention (`fla-core`) can be imported here."""
    return importable("fla")


def kda_backend(device: torch.device) -> str:
    """`fla` on a CUDA device with fla installed, else `torch`; the env var overrides. Raises
    RuntimeError for a CUDA device without fla unless the env var asks for `torch`."""
    backend = choose_backend(BACKEND_ENV, "fla", fla_available(), INSTALL_HINT, device)
    if (
        backend == "torch"
        and device.type == "cuda"
        and os.environ.get(BACKEND_ENV, "").strip().lower() != "torch"
    ):
        raise RuntimeError(
            f"KDA on {device} needs flash-linear-attention, which is not installed here: "
            f"{INSTALL_HINT} (fla-core) on this GPU node. To run the torch reference instead "
            f"(its prefill measured ~37x slower), set {BACKEND_ENV}=torch in the worker's environment."
        )
    return backend


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Many tokens per row: shapes [B, H, L, D], beta [B, H, L]; see `kda_chunked`."""
    if kda_backend(q.device) == "torch":
        return kda_chunked(q, k, v, g, beta, state)
    from fla.ops.kda import chunk_kda

    def tokens_first(x: torch.Tensor) -> torch.Tensor:  # ours [B, H, L, ...] -> fla's [B, L, H, ...]
        return x.transpose(1, 2).contiguous()

    out, final = chunk_kda(
        tokens_first(q),
        tokens_first(k),
        tokens_first(v),
        tokens_first(g),
        tokens_first(beta),
        scale=1.0,
        initial_state=state.float().contiguous(),
        output_final_state=True,
    )
    return out.transpose(1, 2), final


def kda_prefill_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    out: torch.Tensor,
) -> torch.Tensor:
    """Rows of a flat batch (q, k, g [T, H, Dk], v [T, H, Dv], beta [T, H]) on the torch path:
    writes each row's outputs into `out` [T, H, Dv], returns the states after each row's last
    token; see `kda_chunked_varlen`. (fla's varlen call would need `cu_seqlens` on the device.)"""
    return kda_chunked_varlen(q, k, v, g, beta, state, starts, lengths, out)[1]


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q,k,g [N, H, Dk], v [N, H, Dv], beta [N, H]; see `kda_recurrent_step`."""
    if kda_backend(q.device) == "torch":
        return kda_recurrent_step(q, k, v, g, beta, state)
    from fla.ops.kda import fused_recurrent_kda

    def one_step(x: torch.Tensor) -> torch.Tensor:  # [N, H, ...] -> fla's [B=N, T=1, H, ...]
        return x.unsqueeze(1).contiguous()

    out, final = fused_recurrent_kda(
        one_step(q),
        one_step(k),
        one_step(v),
        one_step(g),
        one_step(beta),
        scale=1.0,
        initial_state=state.float().contiguous(),
        output_final_state=True,
    )
    return out.squeeze(1), final


def kda_decode_into(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`kda_decode` on the states `state_pool[slots]`, updated in place; returns the output [N, H, Dv].

    fla reads and writes each row's slot of the pool directly (`ssm_state_indices`), so a decode
    step moves each state once instead of gathering a copy and scattering it back.
    """
    if kda_backend(q.device) == "torch":
        state = state_pool.index_select(0, slots)  # a gathered copy, updated in place, then written back
        out = kda_recurrent_step_(q, k, v, g, beta, state)
        state_pool.index_copy_(0, slots, state)
        return out
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    assert state_pool.dtype == torch.float32 and state_pool.is_contiguous(), (
        "the KDA state pool is fp32, contiguous"
    )
    out, _ = fused_recurrent_kda_fwd(
        *(x.unsqueeze(1).contiguous() for x in (q, k, v, g, beta)),  # [B=N, T=1, H, ...]
        scale=1.0,
        initial_state=state_pool,
        inplace_final_state=True,
        ssm_state_indices=slots.to(torch.int32).contiguous(),
    )
    return out.squeeze(1)
