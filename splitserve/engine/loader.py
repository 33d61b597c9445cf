"""Builds the model and streams a `save_pretrained` checkpoint (one safetensors file or shards) into it.

The model is constructed on the meta device, so construction allocates nothing; every parameter
and buffer is then allocated once, empty, at its final dtype and device, and each checkpoint
tensor is copied into it straight from the memory-mapped shard. Host memory while loading is the
model's own bytes (on a CPU device) plus the shard being read; the device never holds an fp32
copy of a bf16 model.

Accepts both weight layouts in circulation: Moonshot's (`block_sparse_moe.experts.N.w1/w2/w3`,
`q_conv1d/k_conv1d/v_conv1d`), which transformers writes on save, and transformers' in-memory
one (`mlp.experts.gate_up_proj`, `conv1d`, `forget_gate.*`). A missing or unexpected tensor is an
error that names it; shapes are checked on every copy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from splitserve.engine.model.kimi_linear import KimiLinearForCausalLM
from splitserve.engine.model_config import KimiLinearModelConfig

# kept in fp32 whatever the model dtype, as transformers' _keep_in_fp32_modules_strict does
_FP32_SUFFIXES = ("gate.weight", "e_score_correction_bias", "dt_bias")
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w[123])\.weight$")
_TIED_HEAD = "lm_head.weight"


def load_model(
    config: KimiLinearModelConfig, path: str | Path, dtype: torch.dtype, device: torch.device | str
) -> KimiLinearForCausalLM:
    """The model with the checkpoint at `path` loaded, at `dtype` on `device`, fused, in eval mode."""
    with torch.device("meta"):
        model = KimiLinearForCausalLM(config)
    if config.tie_word_embeddings:  # one tensor for both, so the head is never allocated on its own
        model.lm_head.weight = model.model.embed_tokens.weight
    materialize(model, dtype, torch.device(device))
    load_weights(model, path)
    return model.eval()


def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a model tensor is kept in when the model runs in `dtype`."""
    return torch.float32 if name.endswith(_FP32_SUFFIXES) else dtype


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every parameter and buffer uninitialised storage at its final dtype and device, once.

    Tensors shared between modules (tied embeddings) stay shared. Integer buffers keep their
    dtype. The contents are garbage until `load_weights` fills them.
    """
    done: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in own:
            new = done.get(id(tensor))
            if new is None:
                full_name = f"{prefix}.{name}" if prefix else name
                want = param_dtype(full_name, dtype) if tensor.is_floating_point() else tensor.dtype
                new = torch.empty(tensor.shape, dtype=want, device=device)
                if isinstance(tensor, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=False)
                done[id(tensor)] = new
            setattr(module, name, new)


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
    """Every tensor of the checkpoint, one at a time; a shard is unmapped before the next opens."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


@torch.no_grad()
def load_weights(model: KimiLinearForCausalLM, path: str | Path) -> None:
    """Copy every checkpoint tensor into its (already allocated) tensor, then fuse; strict both ways.

    Each copy converts to the destination's dtype and device, so a tensor is never held at a
    wider dtype than the model keeps it in.
    """
    tied = model.config.tie_word_embeddings
    params = dict(model.named_parameters(remove_duplicate=False))
    params |= dict(model.named_buffers(remove_duplicate=False))
    loaded: set[str] = set()
    for raw_name, tensor in iter_checkpoint(Path(path).expanduser()):
        if tied and raw_name == _TIED_HEAD:
            continue  # the head is the embedding; a saved copy of it is redundant
        for name, target_slice, value in _route(raw_name, tensor, params):
            if name not in params:
                raise ValueError(f"checkpoint tensor {raw_name!r} has no place in the model")
            dest = target_slice(params[name])
            if dest.shape != value.shape:
                raise ValueError(
                    f"{raw_name}: checkpoint shape {tuple(value.shape)}, model wants {tuple(dest.shape)}"
                )
            dest.copy_(value)
            loaded.add(name)
    if tied:
        loaded.add(_TIED_HEAD)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:5]}")
    model.finalize()


def _route(name: str, tensor: torch.Tensor, params: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    """Yield (param name, slice of the param to fill, value) for one checkpoint tensor."""
    whole = _whole
    name = name.replace(".mlp.", ".block_sparse_moe.").replace(".self_attn.forget_gate.", ".self_attn.")
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
