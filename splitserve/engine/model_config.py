"""The Kimi-Linear architecture's hyper-parameters, read from a checkpoint's `config.json`.

Reads both spellings transformers accepts: its own attribute names (`num_local_experts`,
`layer_types`, ...) and the checkpoint names Moonshot ships (`num_experts`,
`linear_attn_config.full_attn_layers`, `first_k_dense_replace`, ...). Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# checkpoint spelling -> transformers attribute, as transformers' attribute_map has it
_ALIASES = {
    "model_max_length": "max_position_embeddings",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
    "num_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
}


@dataclass(frozen=True)
class KimiLinearModelConfig:
    """Frozen view of one checkpoint's architecture; everything the engine sizes itself from."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    n_shared_experts: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    hidden_act: str
    rms_norm_eps: float
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    torch_dtype: str | None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def kda_qkv_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @classmethod
    def from_pretrained(cls, path: str | Path) -> KimiLinearModelConfig:
        config_file = Path(path).expanduser() / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: point `model` at a checkpoint folder")
        return cls.from_dict(json.loads(config_file.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KimiLinearModelConfig:
        if raw.get("model_type") not in (None, "kimi_linear"):
            raise ValueError(f"model_type is {raw.get('model_type')!r}; splitserve serves 'kimi_linear'")
        cfg = {_ALIASES.get(k, k): v for k, v in raw.items()}
        linear = cfg.get("linear_attn_config") or {}
        num_layers = int(cfg.get("num_hidden_layers", 27))
        num_heads = int(cfg.get("num_attention_heads", 32))
        if int(cfg.get("num_key_value_heads") or num_heads) != num_heads:
            raise ValueError("MLA layers need num_key_value_heads == num_attention_heads")
        eos = cfg.get("eos_token_id", 163586)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(cfg.get("vocab_size", 163840)),
            hidden_size=int(cfg.get("hidden_size", 2304)),
            intermediate_size=int(cfg.get("intermediate_size", 9216)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1024)),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
            q_lora_rank=cfg.get("q_lora_rank"),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
            v_head_dim=int(cfg.get("v_head_dim") or 128),
            num_local_experts=int(cfg.get("num_local_experts", 256)),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 8),
            n_group=int(cfg.get("n_group", 1)),
            topk_group=int(cfg.get("topk_group") or 1),
            n_shared_experts=int(cfg.get("n_shared_experts", 1)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.446)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            linear_num_heads=int(linear.get("num_heads", cfg.get("linear_num_heads", 32))),
            linear_head_dim=int(linear.get("head_dim", cfg.get("linear_head_dim", 128))),
            linear_conv_kernel_dim=int(
                linear.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4))
            ),
            layer_types=_layer_types(cfg, linear, num_layers),
            mlp_layer_types=_mlp_layer_types(cfg, num_layers),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 1048576)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        )


def _layer_types(cfg: dict[str, Any], linear: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
    elif "full_attn_layers" in linear and "kda_layers" in linear:
        slots: list[str | None] = [None] * num_layers
        for layer in linear["full_attn_layers"]:
            slots[layer - 1] = FULL_ATTENTION  # 1-indexed in Moonshot's checkpoints
        for layer in linear["kda_layers"]:
            slots[layer - 1] = LINEAR_ATTENTION
        if any(s is None for s in slots):
            raise ValueError("linear_attn_config leaves some layers without a type")
        types = tuple(s for s in slots if s is not None)
    else:
        types = tuple(FULL_ATTENTION if i and i % 4 == 0 else LINEAR_ATTENTION for i in range(num_layers))
    if len(types) != num_layers or set(types) - {FULL_ATTENTION, LINEAR_ATTENTION}:
        raise ValueError(f"layer_types must list {num_layers} of {FULL_ATTENTION!r}/{LINEAR_ATTENTION!r}")
    return types


def _mlp_layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    if cfg.get("mlp_layer_types"):
        types = tuple(cfg["mlp_layer_types"])
    else:
        first_dense = int(cfg.get("first_k_dense_replace", 1))
        types = tuple("dense" if i < first_dense else "sparse" for i in range(num_layers))
    if len(types) != num_layers or set(types) - {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types must list {num_layers} of 'dense'/'sparse'")
    return types
