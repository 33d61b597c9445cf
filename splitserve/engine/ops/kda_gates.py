"""KDA's work between its input projection and the delta rule: the short causal conv, q/k L2 norms, the
forget gate and beta. The torch references, and the one-launch decode form on CUDA.

From the projection's outputs (`mixed` = pre-conv q, k, v [T, 3*H*D]; `f` = `f_b_proj(f_a)` [T, H*D];
`b_logit` [T, H]) the delta rule takes, in fp32:

* `q, k, v` [T, H, D]: `silu(conv(mixed))` per channel, q and k L2-normalised per head (FLA's eps inside
  the root), q scaled by `D**-0.5`;
* `g` [T, H, D]: the log forget gate, `-exp(A_log) * softplus(f + dt_bias)` (softplus linear past 20);
* `beta` [T, H]: `sigmoid(b_logit)`.

`kda_decode_gates` is the decode step's (one token per row): each row's conv window is its slot's last
`K-1` inputs and this token (the slot's window is shifted in place). On CUDA (`fused_backend`) it is
one Triton launch (ops/kda_gates_triton.py) instead of ~30 torch ops; the CPU runs the references,
which are also what prefill chunks run (their conv is the layer's chunked one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.engine.ops.kda import l2norm
from splitserve.engine.ops.triton_kernel import fused_backend, kernel_or_torch

KDAInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v, g, beta


def conv_step_torch(
    x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """One token per row: `silu` of the conv over each row's slot window and `x` [N, C]; the window
    (conv_state [slots, C, K-1]) moves on by one. weight [C, K]."""
    # index_select / index_copy_: the fast CPU row gather and scatter
    window = torch.cat([conv_state.index_select(0, slots), x.unsqueeze(-1)], dim=-1)  # [N, C, K]
    conv_state.index_copy_(0, slots, window[:, :, 1:])
    return F.silu((window * weight).sum(-1))


def kda_gates_torch(
    conv_out: torch.Tensor,
    f: torch.Tensor,
    b_logit: torch.Tensor,
    dt_bias: torch.Tensor,
    decay_rate: torch.Tensor,
    num_heads: int,
) -> KDAInputs:
    """q, k, v, g, beta from the conv's output [T, 3*H*D] (see the module doc); decay_rate [H, 1] fp32."""
    dim = conv_out.shape[-1] // 3
    head_dim = dim // num_heads
    q, k, v = (t.float().view(-1, num_heads, head_dim) for t in conv_out.split(dim, dim=-1))
    q = l2norm(q) * (head_dim**-0.5)
    k = l2norm(k)
    g = f.float().view(-1, num_heads, head_dim) + dt_bias.float().view(num_heads, head_dim)
    g = F.softplus(g, threshold=20.0).mul_(-decay_rate)  # log1p(exp(g)), g itself above 20
    beta = torch.sigmoid(b_logit).float()
    return q, k, v, g, beta


def kda_decode_gates(
    mixed: torch.Tensor,
    f: torch.Tensor,
    b_logit: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    slots: torch.Tensor,
    dt_bias: torch.Tensor,
    decay_rate: torch.Tensor,
    num_heads: int,
) -> KDAInputs:
    """A decode step's q, k, v, g, beta (contiguous, fp32), the rows' conv windows moved on in place."""

    def reference() -> KDAInputs:
        conv_out = conv_step_torch(mixed, conv_state, slots, conv_weight)
        return kda_gates_torch(conv_out, f, b_logit, dt_bias, decay_rate, num_heads)

    if fused_backend(mixed.device) == "torch":
        return reference()
    from splitserve.engine.ops.kda_gates_triton import kda_decode_gates_triton

    return kernel_or_torch(
        "kda_decode_gates",
        lambda: kda_decode_gates_triton(
            mixed, f, b_logit, conv_state, conv_weight, slots, dt_bias, decay_rate, num_heads
        ),
        reference,
    )
