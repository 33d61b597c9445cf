"""Tiny random `kimi_linear` checkpoints: the test oracle's model and the laptop demo's model.

`make_tiny_model(dir)` writes a complete Hugging Face checkpoint (config, generation config,
safetensors weights, tokenizer) that `KimiLinearForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load. Every parameter and buffer is drawn from one
`torch.Generator` seeded by `seed`, so the same seed gives byte-identical weights and no two
experts, heads or router biases tie. The module itself is torch-free at import; torch and
transformers load inside the functions that need them.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitserve.tokenizer_files import special_token_ids, write_tokenizer_files

if TYPE_CHECKING:
    import torch

# Bump when a preset or the randomisation changes, so cached checkpoints are rebuilt.
RECIPE_VERSION = 1
RECIPE_FILE = "splitserve_tiny_model.json"

_SHARED_SHAPE: dict[str, Any] = {
    "num_local_experts": 8,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "q_lora_rank": None,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

_KDA, _MLA = "linear_attention", "full_attention"

# ~1.25M parameters: 4 KDA and 2 MLA layers, the first feed-forward dense, the rest MoE.
_TINY: dict[str, Any] = {
    **_SHARED_SHAPE,
    "hidden_size": 96,
    "intermediate_size": 192,
    "moe_intermediate_size": 48,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "layer_types": [_KDA, _MLA, _KDA, _KDA, _MLA, _KDA],
    "mlp_layer_types": ["dense"] + ["sparse"] * 5,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    # `tiny` with a 64k context, for long prompts (experiments/long_prompt.py). Kimi-Linear's MLA
    # has no RoPE, so the context is only this limit: the same seed gives `tiny`'s weights.
    "tiny-long": {**_TINY, "max_position_embeddings": 65536},
    # ~10M parameters, the same shape family, for benchmarks.
    "bench-10m": {
        **_SHARED_SHAPE,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "moe_intermediate_size": 144,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "linear_num_heads": 4,
        "linear_head_dim": 32,
        "layer_types": [_KDA, _KDA, _KDA, _MLA, _KDA, _KDA, _KDA, _MLA],
        "mlp_layer_types": ["dense"] + ["sparse"] * 7,
    },
    # Wide KDA heads on a narrow model, for the handoff-gap experiment: one request carries
    # ~64 MiB of state (8 KDA layers x 32 heads x 256 x 256 fp32 recurrent, plus conv windows and
    # MLA rows) while a step stays cheap on a CPU (70M parameters, mostly KDA projections; hidden size 128).
    "handoff-64m": {
        **_SHARED_SHAPE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 10,
        "num_attention_heads": 4,
        "linear_num_heads": 32,
        "linear_head_dim": 256,
        "layer_types": [_KDA, _KDA, _KDA, _KDA, _MLA] * 2,
        "mlp_layer_types": ["dense"] * 10,
    },
}

# Output projections write into the residual stream; a smaller gain keeps it from growing
# layer by layer. The lm_head gain sets how peaked the logits are (std ~1.5 over the vocabulary),
# which keeps top-1/top-2 near ties rare.
_RESIDUAL_GAIN = 0.5
_LM_HEAD_GAIN = 1.5
_NORM_NOISE = 0.1
_ROUTER_BIAS_RANGE = 0.1


def make_tiny_model(
    path: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a random `kimi_linear` checkpoint with its tokenizer into `path` and return it.

    `config_overrides` go into `KimiLinearConfig` on top of the preset (e.g. `layer_types`,
    `q_lora_rank`, `linear_conv_kernel_dim`); a changed `num_hidden_layers` without explicit
    layer patterns gets the preset's patterns repeated to the new length.
    """
    try:
        import torch
        from transformers import KimiLinearConfig, KimiLinearForCausalLM
    except ModuleNotFoundError as exc:  # a base install (gateway node) has neither
        raise ModuleNotFoundError(
            f"building a tiny model needs the engine's dependencies ({exc.name} is missing): "
            "pip install 'splitserve[engine]', or point model.path at an existing checkpoint",
            name=exc.name,
        ) from exc

    path = Path(path)
    tokenizer = write_tokenizer_files(path, model_max_length=_max_length(preset, config_overrides))
    config_kwargs: dict[str, Any] = {
        "vocab_size": tokenizer.get_vocab_size(),
        "dtype": "float32",
        **special_token_ids(tokenizer),
        **_config_kwargs(preset, config_overrides),
    }
    config = KimiLinearConfig(**config_kwargs)
    # Construction draws from the global RNG; fork it so the caller's stream is left untouched.
    with torch.random.fork_rng(devices=[]):
        model = KimiLinearForCausalLM(config)
    randomize_weights(model, seed=seed)
    model.save_pretrained(path)
    recipe = {"version": RECIPE_VERSION, "preset": preset, "seed": seed, "overrides": config_overrides}
    (path / RECIPE_FILE).write_text(json.dumps(recipe, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def randomize_weights(model: torch.nn.Module, *, seed: int) -> None:
    """Overwrite every parameter and floating buffer of a `kimi_linear` model in place.

    Linear weights get std `gain / sqrt(fan_in)`; RMSNorm weights `1 + 0.1 * randn`; router
    score-correction biases `uniform(-0.1, 0.1)`; KDA `A_log` and `dt_bias` follow FLA's ranges.
    A tensor this function does not recognise is an error rather than silently left as is.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    with torch.no_grad():
        for name, tensor in tensors:
            if tensor.is_floating_point():
                tensor.copy_(_draw(name, tuple(tensor.shape), generator).to(tensor.dtype))


def num_checkpoint_elements(path: str | Path) -> int:
    """Elements of every tensor in `path`/model.safetensors (router bias buffers included).

    Reads only the safetensors header, so it needs neither torch nor the weights in memory.
    """
    with open(Path(path) / "model.safetensors", "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return sum(math.prod(entry["shape"]) for entry in header.values())


def _config_kwargs(preset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    kwargs = {**PRESETS[preset], **overrides}
    num_layers = kwargs["num_hidden_layers"]
    for key in ("layer_types", "mlp_layer_types"):
        if key not in overrides and len(kwargs[key]) != num_layers:
            pattern = PRESETS[preset][key]
            kwargs[key] = [pattern[i % len(pattern)] for i in range(num_layers)]
    if "num_key_value_heads" not in overrides:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    return kwargs


def _max_length(preset: str, overrides: dict[str, Any]) -> int:
    base = PRESETS.get(preset, _SHARED_SHAPE)
    return int(overrides.get("max_position_embeddings", base["max_position_embeddings"]))


def _draw(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    import torch

    def randn(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32) * std

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=generator, dtype=torch.float32) * (high - low) + low

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "e_score_correction_bias":
        return uniform(-_ROUTER_BIAS_RANGE, _ROUTER_BIAS_RANGE)
    if leaf == "A_log":
        return uniform(1.0, 16.0).log()
    if leaf == "dt_bias":
        # softplus(dt_bias) lands in [1e-3, 1e-1], as in FLA's initialisation.
        dt = uniform(math.log(1e-3), math.log(1e-1)).exp()
        return dt + torch.log(-torch.expm1(-dt))
    if "norm" in name and leaf == "weight":
        return 1.0 + randn(_NORM_NOISE)
    if leaf == "bias":
        return randn(0.02)
    if name.endswith("embed_tokens.weight"):
        return randn(1.0)
    if "conv1d" in name:
        return randn(1.0 / math.sqrt(shape[-1]))
    if len(shape) >= 2:
        fan_in = shape[-1]
        if name.startswith("lm_head"):
            gain = _LM_HEAD_GAIN
        elif leaf in ("o_proj", "down_proj") or name.endswith(("o_proj.weight", "down_proj.weight")):
            gain = _RESIDUAL_GAIN
        else:
            gain = 1.0
        return randn(gain / math.sqrt(fan_in))
    raise ValueError(f"randomize_weights does not know how to draw {name!r} of shape {shape}")
