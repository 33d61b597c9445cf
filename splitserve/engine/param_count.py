"""How many parameters the engine's model has and how many bytes its weights take, from the config alone.

Torch-free arithmetic that mirrors `splitserve.engine.model` tensor by tensor, so a memory plan
can be made on a GPU-less head node before the checkpoint is downloaded (only its config.json
is needed). `tests/engine/test_param_count.py` checks it against the real model built on
torch's meta device, for tiny configs and the 48B shape.

Bytes follow the loader: every tensor in the model dtype except the router weight, its
score-correction bias and KDA's `dt_bias`, which stay fp32 (`loader._FP32_SUFFIXES`). After
loading, `finalize()` builds fused copies (the dense MLPs' gate_up, KDA's in_proj and conv
weight, MLA's absorbed w_uk/w_uv) beside the originals; they are counted separately. Under tensor
(and expert) parallelism every count is one rank's, which the test checks against a rank's model.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.model_config import FULL_ATTENTION, KimiLinearModelConfig
from splitserve.engine_config import DTYPE_BYTES

FP32_BYTES = 4


@dataclass(frozen=True)
class WeightCount:
    """Elements of a model's parameters and buffers, split by the dtype they are kept in.

    `num_fused_elements` are the copies `finalize()` builds at load, in the model dtype, plus
    `num_fused_fp32_elements` (KDA's decay rate) in fp32.
    """

    num_params: int  # parameters and buffers, as `model.parameters()` + `model.buffers()` count them
    num_fp32_params: int  # of those, kept in fp32 whatever the model dtype
    num_fused_elements: int
    num_fused_fp32_elements: int

    def weight_bytes(self, dtype: str) -> int:
        """The loaded parameters and buffers, in `dtype` except the fp32-kept ones."""
        return (self.num_params - self.num_fp32_params) * DTYPE_BYTES[
            dtype
        ] + self.num_fp32_params * FP32_BYTES

    def fused_bytes(self, dtype: str) -> int:
        """The fused copies built after loading."""
        return self.num_fused_elements * DTYPE_BYTES[dtype] + self.num_fused_fp32_elements * FP32_BYTES

    def __add__(self, other: WeightCount) -> WeightCount:
        return WeightCount(
            self.num_params + other.num_params,
            self.num_fp32_params + other.num_fp32_params,
            self.num_fused_elements + other.num_fused_elements,
            self.num_fused_fp32_elements + other.num_fused_fp32_elements,
        )


def count_weights(
    config: KimiLinearModelConfig, tensor_parallel: int = 1, expert_parallel: bool = False
) -> WeightCount:
    """The whole model: embeddings, every decoder layer, the final norm and the LM head; with
    `tensor_parallel` N, one rank's share (engine/parallel/: heads, MLP columns and the vocabulary
    cut N ways, the MLA latent path, norms and router whole on every rank; `expert_parallel`: whole
    experts, E / N of them, instead of every expert's cut columns)."""
    cut = _Cut(tensor_parallel, expert_parallel)
    h, v = config.hidden_size, cut(config.vocab_size)
    lm_head = 0 if config.tie_word_embeddings else v * h  # a tied head is the embedding itself
    total = WeightCount(v * h + h + lm_head, 0, 0, 0)
    for layer_id, mixer in enumerate(config.layer_types):
        total += WeightCount(2 * h, 0, 0, 0)  # input and post-attention RMSNorms
        total += _mla(config, cut) if mixer == FULL_ATTENTION else _kda(config, cut)
        if config.mlp_layer_types[layer_id] == "sparse":
            total += _moe(config, cut)
        else:
            total += _gated_mlp(h, cut(config.intermediate_size))
    return total


@dataclass(frozen=True)
class _Cut:
    """One rank's share of a dimension the ranks split (the layers' `TensorParallel.split`)."""

    num_ranks: int
    expert_parallel: bool

    def __call__(self, count: int) -> int:
        return count // self.num_ranks


def _gated_mlp(hidden: int, intermediate: int) -> WeightCount:
    # gate, up and down projections; finalize() concatenates gate and up into gate_up
    return WeightCount(3 * hidden * intermediate, 0, 2 * hidden * intermediate, 0)


def _moe(config: KimiLinearModelConfig, cut: _Cut) -> WeightCount:
    h, e, i = config.hidden_size, config.num_local_experts, config.moe_intermediate_size
    router = e * h + e  # fp32 weight and e_score_correction_bias buffer, whole on every rank
    # w13 [E, 2I, H] and w2 [E, H, I]: whole experts per rank, or each expert's columns cut
    experts = cut(e) * 3 * i * h if cut.expert_parallel else e * 3 * cut(i) * h
    return WeightCount(router + experts, router, 0, 0) + _gated_mlp(h, cut(i * config.n_shared_experts))


def _mla(config: KimiLinearModelConfig, cut: _Cut) -> WeightCount:
    h, heads, rank = config.hidden_size, cut(config.num_attention_heads), config.kv_lora_rank
    bias = config.attention_bias
    qk = heads * config.qk_head_dim
    if config.q_lora_rank is None:
        q = h * qk
    else:
        r = config.q_lora_rank
        q = h * r + (r if bias else 0) + r + r * qk  # q_a_proj (+ bias), q_a_layernorm, q_b_proj
    kv_a_out = rank + config.qk_rope_head_dim  # the latent: whole on every rank
    kv_a = h * kv_a_out + (kv_a_out if bias else 0)
    kv_b = rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
    o = heads * config.v_head_dim * h + (h if bias else 0)
    # finalize() splits kv_b_proj into the absorbed w_uk and w_uv copies: kv_b's elements again
    return WeightCount(q + kv_a + rank + kv_b + o, 0, kv_b, 0)


def _kda(config: KimiLinearModelConfig, cut: _Cut) -> WeightCount:
    h, heads, head_dim = config.hidden_size, cut(config.linear_num_heads), config.linear_head_dim
    dim, kernel = heads * head_dim, config.linear_conv_kernel_dim
    in_rows = 3 * dim + head_dim + heads + head_dim  # q, k, v, f_a, b, g_a: fused into in_proj
    params = (
        in_rows * h
        + 3 * dim * kernel  # q/k/v depthwise convs, fused into conv_weight
        + 2 * head_dim * dim  # f_b_proj, g_b_proj
        + dim  # dt_bias (fp32)
        + heads  # A_log
        + head_dim  # o_norm
        + dim * h  # o_proj
    )
    return WeightCount(params, dim, in_rows * h + 3 * dim * kernel, heads)
