"""Loads a `save_pretrained` checkpoint (one safetensors file or shards with an index) into the model.

Accepts both weight layouts in circulation: Moonshot's (`block_sparse_moe.experts.N.w1/w2/w3`,
`q_conv1d/k_conv1d/v_conv1d`), which transformers writes on save, and transformers' in-memory
one (`mlp.experts.gate_up_proj`, `conv1d`). A missing or unexpected tensor is an error that
names it; shapes are checked on every copy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.engine.model.kimi_linear import KimiLinearForCausalLM

# kept in fp32 whatever the model dtype, as transformers' _keep_in_fp32_modules_strict does
_FP32_SUFFIXES = ("gate.weight", "e_score_correction_bias", "dt_bias")
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w[123])\.weight$")


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_weights(model: KimiLinearForCausalLM, path: str | Path, dtype: torch.dtype) -> None:
    """Copy every checkpoint tensor into its parameter, then cast and fuse; strict both ways."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    loaded: set[str] = set()
    for raw_name, tensor in iter_checkpoint(Path(path).expanduser()):
        for name, target_slice, value in _route(raw_name, tensor, params):
            if name not in params:
                raise ValueError(f"checkpoint tensor {raw_name!r} has no place in the model")
            dest = target_slice(params[name].data)
            if dest.shape != value.shape:
                raise ValueError(
                    f"{raw_name}: checkpoint shape {tuple(value.shape)}, model wants {tuple(dest.shape)}"
                )
            dest.copy_(value)
            loaded.add(name)
    if model.config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:5]}")
    for name, p in params.items():
        if not name.endswith(_FP32_SUFFIXES):
            p.data = p.data.to(dtype)
    model.finalize()


def _route(name: str, tensor: torch.Tensor, params: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    """Yield (param name, slice of the param to fill, value) for one checkpoint tensor."""
    whole = _whole
    name = name.replace(".mlp.", ".block_sparse_moe.")
    expert = _EXPERT.match(name)
    if expert:
        prefix, index, which = expert.group(1), int(expert.group(2)), expert.group(3)
        if which == "w2":
            yield f"{prefix}.w2", lambda p: p[index], tensor
        else:
            half = tensor.shape[0]
            lo = 0 if which == "w1" else half
            yield f"{prefix}.w13", lambda p: p[index, lo : lo + half], tensor
        return
    if name.endswith(".experts.gate_up_proj"):
        yield name.replace("gate_up_proj", "w13"), whole, tensor
    elif name.endswith(".experts.down_proj"):
        yield name.replace("down_proj", "w2"), whole, tensor
    elif name.endswith(".self_attn.conv1d.weight"):
        for part, chunk in zip("qkv", tensor.chunk(3, dim=0)):
            yield name.replace(".conv1d.", f".{part}_conv1d."), whole, chunk
    else:
        yield name, whole, tensor


def _whole(p: torch.Tensor) -> torch.Tensor:
    return p
