"""The torch-free weight arithmetic equals the real model's tensors, counted on the meta device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from splitserve.engine.loader import _FP32_SUFFIXES
from splitserve.engine.model.kimi_linear import KimiLinearForCausalLM
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.parallel.group import SINGLE, TensorParallel
from splitserve.engine.param_count import count_weights
from splitserve.tiny_model import PRESETS

CONFIG_48B = (
    Path(__file__).resolve().parents[2] / "deploy/configs/models/Kimi-Linear-48B-A3B-Instruct/config.json"
)


def _tiny(**overrides: Any) -> dict[str, Any]:
    return {**PRESETS["tiny"], "vocab_size": 300, **overrides}


CONFIGS = {
    "tiny": _tiny(),
    "bench-10m": {**PRESETS["bench-10m"], "vocab_size": 1000},
    "q-lora-and-bias": _tiny(q_lora_rank=24, attention_bias=True),
    "tied-two-shared-experts": _tiny(tie_word_embeddings=True, n_shared_experts=2),
    "all-dense-conv3": _tiny(mlp_layer_types=["dense"] * 6, linear_conv_kernel_dim=3),
    "48b": json.loads(CONFIG_48B.read_text()),
}


def _meta_counts(config: KimiLinearModelConfig, tp: TensorParallel = SINGLE) -> tuple[int, int, int, int]:
    """(elements, fp32-kept elements, fused elements, fused fp32 elements) of the real model (a rank's)."""
    with torch.device("meta"):
        model = KimiLinearForCausalLM(config, tp)
        model.finalize()  # ties the head and builds the fused copies, on meta: no memory
    named = [*model.named_parameters(), *model.named_buffers()]
    total = sum(t.numel() for _, t in named)
    fp32 = sum(t.numel() for name, t in named if name.endswith(_FP32_SUFFIXES))
    owned = {id(t) for _, t in named}
    fused = {
        (id(value), attribute): value.numel()
        for module in model.modules()
        for attribute, value in vars(module).items()
        if isinstance(value, torch.Tensor) and id(value) not in owned
    }
    fused_fp32 = sum(n for (_, attribute), n in fused.items() if attribute == "decay_rate")  # A_log.exp()
    return total, fp32, sum(fused.values()) - fused_fp32, fused_fp32


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_arithmetic_equals_the_model_built_on_meta(name):
    config = KimiLinearModelConfig.from_dict(CONFIGS[name])
    counted = count_weights(config)
    assert (
        counted.num_params,
        counted.num_fp32_params,
        counted.num_fused_elements,
        counted.num_fused_fp32_elements,
    ) == _meta_counts(config)


def test_the_48b_checkpoint_has_49_1b_parameters_and_91_5_gib_of_bf16_weights():
    counted = count_weights(KimiLinearModelConfig.from_dict(CONFIGS["48b"]))
    assert 49.0e9 < counted.num_params < 49.2e9
    # all but the fp32-kept router weights, router biases and dt_bias at 2 bytes
    assert counted.weight_bytes("bfloat16") == 2 * counted.num_params + 2 * counted.num_fp32_params
    assert 91 * 2**30 < counted.weight_bytes("bfloat16") < 92 * 2**30


@pytest.mark.parametrize("size,expert_parallel", [(2, False), (4, True), (16, True)])
@pytest.mark.parametrize("name", ["q-lora-and-bias", "tied-two-shared-experts", "48b"])
def test_a_ranks_share_equals_the_rank_built_on_meta(name, size, expert_parallel):
    config = KimiLinearModelConfig.from_dict(CONFIGS[name])
    tp = TensorParallel(1, size, expert_parallel)
    try:
        tp.check_model(config)
    except ValueError:
        pytest.skip(f"{name} does not split {size} ways")
    counted = count_weights(config, size, expert_parallel)
    assert (
        counted.num_params,
        counted.num_fp32_params,
        counted.num_fused_elements,
        counted.num_fused_fp32_elements,
    ) == _meta_counts(config, tp)
