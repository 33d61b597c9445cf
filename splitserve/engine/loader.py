"""Builds the model and streams a `save_pretrained` checkpoint (one safetensors file or shards) into it.

The model is constructed on the meta device, so construction allocates nothing; every parameter
and buffer is then allocated once, empty, at its final dtype and device, and each checkpoint
tensor is copied into it straight from the memory-mapped shard. Host memory while loading is the
model's own bytes (on a CPU device) plus the shard being read; the device never holds an fp32
copy of a bf16 model.

Under tensor parallelism each parameter carries its `Shard` (set by its layer); the loader reads
from each checkpoint tensor only the slices the rank keeps (safetensors slices the mapped file), so
a rank never holds more of the checkpoint than its shard and the tensor being copied.

Accepts both weight layouts in circulation: Moonshot's (`block_sparse_moe.experts.N.w1/w2/w3`,
`q_conv1d/k_conv1d/v_conv1d`), which transformers writes on save, and transformers' in-memory
one (`mlp.experts.gate_up_proj`, `conv1d`, `forget_gate.*`). A missing or unexpected tensor is an
error that names it; shapes are checked on every copy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from splitserve.engine.model.kimi_linear import KimiLinearForCausalLM
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.parallel.group import SINGLE, TensorParallel
from splitserve.engine.parallel.shard import Shard, placements, set_shard, shard_of

# kept in fp32 whatever the model dtype, as transformers' _keep_in_fp32_modules_strict does
_FP32_SUFFIXES = ("gate.weight", "e_score_correction_bias", "dt_bias")
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w[123])\.weight$")
_TIED_HEAD = "lm_head.weight"


def load_model(
    config: KimiLinearModelConfig,
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TensorParallel = SINGLE,
) -> KimiLinearForCausalLM:
    """The model with the checkpoint at `path` loaded, at `dtype` on `device`, fused, in eval mode;
    under tensor parallelism, this rank's shard of it (only the slices it keeps are read)."""
    with torch.device("meta"):
        model = KimiLinearForCausalLM(config, tp)
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
                set_shard(new, shard_of(tensor))
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


def iter_checkpoint(path: Path) -> Iterator[tuple[str, Any]]:
    """Every tensor of the checkpoint as a lazy safetensors slice (read with `slice[index]`), one at
    a time; a shard is unmapped before the next opens."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_slice(name)


@dataclass(frozen=True)
class _Piece:
    """A region of one checkpoint tensor (`start`, `size` in its own dims) and where it sits in a
    full parameter: `offset` per parameter dim, the first `lead` of which the tensor lacks (an
    expert's index in the stacked experts)."""

    param: str
    offset: tuple[int, ...]
    lazy: Any
    start: tuple[int, ...]
    size: tuple[int, ...]
    lead: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return (1,) * self.lead + self.size

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        """The tensor at `index` (slices over `shape`), read from the file."""
        own = index[self.lead :]
        return self.lazy[tuple(slice(a + s.start, a + s.stop) for a, s in zip(self.start, own))]


@torch.no_grad()
def load_weights(model: KimiLinearForCausalLM, path: str | Path) -> None:
    """Copy every checkpoint tensor (this rank's slices of it) into its already allocated tensor,
    then fuse; strict both ways.

    Each copy converts to the destination's dtype and device, so a tensor is never held at a
    wider dtype than the model keeps it in.
    """
    tied = model.config.tie_word_embeddings
    params = dict(model.named_parameters(remove_duplicate=False))
    params |= dict(model.named_buffers(remove_duplicate=False))
    loaded: set[str] = set()
    for raw_name, lazy in iter_checkpoint(Path(path).expanduser()):
        if tied and raw_name == _TIED_HEAD:
            continue  # the head is the embedding; a saved copy of it is redundant
        for piece in _route(raw_name, lazy):
            param = params.get(piece.param)
            if param is None:
                raise ValueError(f"checkpoint tensor {raw_name!r} has no place in the model")
            shard = shard_of(param)
            _check_fits(raw_name, piece, _full_shape(param, shard))
            for src, dst in placements(param.shape, shard, piece.offset, piece.shape):
                param[dst].copy_(piece.read(src).view(param[dst].shape))
            loaded.add(piece.param)
    if tied:
        loaded.add(_TIED_HEAD)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:5]}")
    model.finalize()


def _full_shape(param: torch.Tensor, shard: Shard | None) -> tuple[int, ...]:
    """The shape of the whole (unsharded) parameter a rank's `param` is cut from."""
    shape = list(param.shape)
    if shard is not None:
        shape[shard.dim] *= shard.num_ranks
    return tuple(shape)


def _check_fits(raw_name: str, piece: _Piece, full: tuple[int, ...]) -> None:
    """A whole tensor must have the parameter's shape; a part (an expert, a q/k/v third) fit in it."""
    whole = not piece.lead and not any(piece.offset)
    ends = tuple(o + n for o, n in zip(piece.offset, piece.shape))
    if len(piece.shape) != len(full) or (
        piece.shape != full if whole else any(e > f for e, f in zip(ends, full))
    ):
        raise ValueError(f"{raw_name}: checkpoint shape {piece.size}, model wants {full}")


def _route(name: str, lazy: Any) -> Iterator[_Piece]:
    """The pieces one checkpoint tensor holds, each with the parameter it fills and where."""
    shape = tuple(lazy.get_shape())
    zeros = (0,) * len(shape)
    name = name.replace(".mlp.", ".block_sparse_moe.").replace(".self_attn.forget_gate.", ".self_attn.")
    expert = _EXPERT.match(name)
    if expert:
        prefix, index, which = expert.group(1), int(expert.group(2)), expert.group(3)
        rows = shape[0] if which == "w3" else 0  # up rows follow the gate rows in w13
        param = f"{prefix}.w2" if which == "w2" else f"{prefix}.w13"
        yield _Piece(param, (index, rows, 0), lazy, zeros, shape, lead=1)
    elif name.endswith(".experts.gate_up_proj"):
        yield _Piece(name.replace("gate_up_proj", "w13"), zeros, lazy, zeros, shape)
    elif name.endswith(".experts.down_proj"):
        yield _Piece(name.replace("down_proj", "w2"), zeros, lazy, zeros, shape)
    elif name.endswith(".self_attn.conv1d.weight"):
        third = shape[0] // 3
        for i, part in enumerate("qkv"):
            start = (i * third, *zeros[1:])
            yield _Piece(
                name.replace(".conv1d.", f".{part}_conv1d."), zeros, lazy, start, (third, *shape[1:])
            )
    else:
        yield _Piece(name, zeros, lazy, zeros, shape)
