"""Checkpoints load in every layout save_pretrained writes, in fp32 and bf16; bad ones fail clearly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine_config import EngineConfig
from tests.oracle import hf_logits

PROMPT = list(range(5, 70))


def _logits(path, dtype="float32"):
    return LLMEngine(EngineConfig(model=str(path), dtype=dtype, max_model_len=256)).prompt_logits(PROMPT)


def test_sharded_checkpoint_loads_like_a_single_file(tiny_model_path, tmp_path):
    from transformers import KimiLinearForCausalLM

    sharded = tmp_path / "sharded"
    KimiLinearForCausalLM.from_pretrained(str(tiny_model_path)).save_pretrained(
        sharded, max_shard_size="300KB"
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    assert (
        len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))
        > 1
    )
    torch.testing.assert_close(_logits(sharded), _logits(tiny_model_path), atol=0, rtol=0)


def test_bfloat16_matches_transformers_in_bfloat16(tiny_model_path):
    from transformers import KimiLinearForCausalLM

    hf = KimiLinearForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    got = _logits(tiny_model_path, "bfloat16")
    fp32 = hf_logits(tiny_model_path, PROMPT)
    # bf16 rounds op by op, so compare like with like: close to transformers' own bf16, and no
    # further from fp32 than transformers' bf16 is. A rounding can flip a near-tied expert choice
    # and move that one position's logits by ~1 (either side: both bf16 runs flip some position
    # fp32 does not), so the closeness bound holds per position, for all but a few positions
    close_positions = ((got - expected).abs().amax(-1) < 0.15).float().mean()
    assert close_positions > 0.9
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
    assert (got - fp32).abs().mean() < 1.5 * (expected - fp32).abs().mean()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst / "model.safetensors"


def test_missing_tensor_is_named(tiny_model_path, tmp_path):
    weights_file = _copy(tiny_model_path, tmp_path / "m")
    weights = load_file(weights_file)
    del weights["model.norm.weight"]
    save_file(weights, weights_file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e.g. \['model.norm.weight'\]"):
        _logits(tmp_path / "m")


def test_wrong_shape_is_named(tiny_model_path, tmp_path):
    weights_file = _copy(tiny_model_path, tmp_path / "m")
    weights = load_file(weights_file)
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, weights_file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.norm.weight: checkpoint shape \(3,\)"):
        _logits(tmp_path / "m")


def test_unexpected_tensor_is_named(tiny_model_path, tmp_path):
    weights_file = _copy(tiny_model_path, tmp_path / "m")
    weights = load_file(weights_file)
    weights["model.extra.weight"] = torch.ones(3)
    save_file(weights, weights_file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.extra.weight' has no place in the model"):
        _logits(tmp_path / "m")
