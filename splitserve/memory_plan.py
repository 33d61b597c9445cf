"""A memory plan per pool, made before anything starts: weights, activations, KV blocks, state slots.

`plan_cluster(config, model)` answers, for each pool's workers and without allocating anything,
what one device (one rank) holds: the weights (from `engine.param_count`: a rank's share under
`tensor_parallel`, with or without `expert_parallel`; the MLA latent path, norms and routers are
whole on every rank), the fused copies the engine builds at load, an activation margin, and the pool's
`kv_cache_memory_bytes`, which buys `max_num_seqs` state slots and KV blocks with the rest
(`engine.cache_spec.plan_cache`, the arithmetic the engine allocates by: per rank, KDA slots hold
its heads' states and MLA blocks every token's whole latent), and with prefix caching on the KDA
snapshot pool beside it (`cache.snapshot_memory_bytes`, whole snapshots only); and what a step
sends between a replica's ranks (`engine.parallel.layout`). It needs only the checkpoint's
config.json, so it runs on a GPU-less head node before a download. Torch-free.

The activation margin is an estimate, not a measurement: per batched token, 4 bytes (fp32, the
widest dtype a forward upcasts to) times `4 * hidden_size` (residual, normed input, attention
output, MLP output) plus the widest intermediate of any layer (MLA's absorbed query and latent
output, KDA's fused projection, the dense MLP's or the routed experts' gate_up); plus fp32
logits for `max_num_seqs` rows, twice (logits and sampling probabilities); plus, on a GPU,
`CUDA_RUNTIME_BYTES` for the CUDA context, library workspaces and allocator slack. It assumes
attention that reads the paged KV cache in place; the torch reference MLA gathers each
request's whole context into a dense tensor, which this margin does not cover at long contexts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.config import ClusterConfig
from splitserve.device_memory import host_memory_bytes, visible_gpu_memory_bytes
from splitserve.engine.cache_spec import CachePlan, plan_cache
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.parallel.layout import StepTraffic, check_splits, step_traffic
from splitserve.engine.param_count import count_weights
from splitserve.engine_config import EngineConfig

ACTIVATION_BYTES_PER_ELEMENT = 4
CUDA_RUNTIME_BYTES = 2**30


@dataclass(frozen=True)
class ActivationMargin:
    """What a forward step needs beside the weights and the cache (see the module docstring)."""

    bytes_per_token: int
    num_batched_tokens: int
    logits_bytes: int
    runtime_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_batched_tokens + self.logits_bytes + self.runtime_bytes


def activation_margin(model: KimiLinearModelConfig, engine: EngineConfig) -> ActivationMargin:
    """The margin one worker of `engine`'s pool (one rank of it) keeps free for activations; the
    logits are rank 0's, which gathers the whole vocabulary to sample."""
    n = engine.tensor_parallel_size
    heads, linear_heads = model.num_attention_heads // n, model.linear_num_heads // n
    # a rank's experts are whole with expert parallelism: every choice may land on it
    expert_width = model.moe_intermediate_size // (1 if engine.expert_parallel else n)
    shared_width = model.moe_intermediate_size * model.n_shared_experts // n
    widest = max(
        heads * (model.qk_head_dim + model.kv_lora_rank + model.qk_rope_head_dim),
        4 * linear_heads * model.linear_head_dim + 2 * model.linear_head_dim + linear_heads,
        2 * model.intermediate_size // n,
        2 * (expert_width * model.num_experts_per_tok + shared_width),
    )
    per_token = ACTIVATION_BYTES_PER_ELEMENT * (4 * model.hidden_size + widest)
    logits = 2 * engine.max_num_seqs * model.vocab_size * ACTIVATION_BYTES_PER_ELEMENT
    runtime = CUDA_RUNTIME_BYTES if engine.device == "cuda" else 0
    return ActivationMargin(per_token, engine.max_num_batched_tokens, logits, runtime)


@dataclass(frozen=True)
class PoolPlan:
    """One pool's plan for one of its workers' devices, and whether it fits.

    `cache` is None when the pool's KV budget cannot hold even one request of `max_model_len`
    (then `cache_error` says why). `device_memory_bytes` is None when neither the config nor
    this machine says what the device has; then `fits` is None (unknown).
    """

    pool: str
    device: str  # "cuda" or "cpu"
    replicas: int
    tensor_parallel: int  # ranks (devices) per replica
    num_params: int  # per rank
    weight_bytes: int  # per device (rank): its share of the loaded weights
    fused_bytes: int  # per device: the copies finalize() builds at load
    activation: ActivationMargin
    kv_cache_memory_bytes: int
    unit: CachePlan  # bytes per block and per slot; num_slots = max_num_seqs, no blocks
    cache: CachePlan | None
    max_model_len: int | None  # what the worker serves with the configured budget
    cache_error: str | None
    device_memory_bytes: int | None
    device_memory_source: str
    expert_parallel: bool = False
    traffic: StepTraffic | None = None  # between the ranks of a replica (None with one rank)

    @property
    def snapshot_bytes(self) -> int:
        """The prefix cache's KDA snapshot pool, allocated beside the KV budget (0 without caching)."""
        return self.cache.snapshot_bytes if self.cache is not None else 0

    @property
    def need_bytes(self) -> int:
        return (
            self.weight_bytes
            + self.fused_bytes
            + self.activation.total_bytes
            + self.kv_cache_memory_bytes
            + self.snapshot_bytes
        )

    @property
    def left_for_cache_bytes(self) -> int | None:
        """What the device has for KV blocks and state slots after weights and activations."""
        if self.device_memory_bytes is None:
            return None
        return self.device_memory_bytes - self.weight_bytes - self.fused_bytes - self.activation.total_bytes

    @property
    def num_blocks_if_all_left(self) -> int | None:
        """KV blocks the device could hold beside `max_num_seqs` slots if the budget took all that is left."""
        left = self.left_for_cache_bytes
        if left is None:
            return None
        left -= self.num_slots * self.unit.slot_bytes
        return max(0, left // self.unit.block_bytes) if self.unit.block_bytes else 0

    @property
    def num_slots(self) -> int:
        """State slots: one per request running at once (`max_num_seqs`), paid for first."""
        return self.unit.num_slots

    @property
    def fits(self) -> bool | None:
        if self.cache is None:
            return False
        left = self.left_for_cache_bytes
        return None if left is None else self.kv_cache_memory_bytes + self.snapshot_bytes <= left

    def problems(self) -> list[str]:
        """Why the plan does not fit, each naming the pool, the numbers and what to change."""
        found = []
        if self.cache_error is not None:
            found.append(f"{self.pool}: {self.cache_error}")
        left = self.left_for_cache_bytes
        if left is None or self.kv_cache_memory_bytes + self.snapshot_bytes <= left:
            return found
        left -= self.snapshot_bytes  # what the KV budget may take beside the snapshot pool
        smallest = self.num_slots * self.unit.slot_bytes + self.unit.block_bytes
        fix = (
            f"lower {self.pool}.kv_cache_memory_bytes to at most {human_bytes(left)}"
            if left >= smallest
            else f"even {self.num_slots} state slots and one KV block ({human_bytes(smallest)}) do not fit beside the "
            f"weights: lower {self.pool}.max_num_seqs or {self.pool}.max_num_batched_tokens"
        )
        found.append(
            f"{self.pool}: needs {human_bytes(self.need_bytes)} per device (weights {human_bytes(self.weight_bytes)}, "
            f"fused copies {human_bytes(self.fused_bytes)}, activations {human_bytes(self.activation.total_bytes)}, "
            f"kv_cache_memory_bytes {human_bytes(self.kv_cache_memory_bytes)}, prefix snapshots "
            f"{human_bytes(self.snapshot_bytes)}) but the device has "
            f"{human_bytes(self.device_memory_bytes or 0)} ({self.device_memory_source}); {fix}, or use a "
            "bigger device (or a smaller dtype)"
        )
        return found

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON types (`splitserve config plan --json`)."""
        return {
            "pool": self.pool,
            "device": self.device,
            "replicas": self.replicas,
            "tensor_parallel": self.tensor_parallel,
            "expert_parallel": self.expert_parallel,
            "num_params": self.num_params,
            "weight_bytes": self.weight_bytes,
            "fused_bytes": self.fused_bytes,
            "activation_bytes": self.activation.total_bytes,
            "activation_bytes_per_token": self.activation.bytes_per_token,
            "logits_bytes": self.activation.logits_bytes,
            "runtime_bytes": self.activation.runtime_bytes,
            "device_memory_bytes": self.device_memory_bytes,
            "device_memory_source": self.device_memory_source,
            "left_for_cache_bytes": self.left_for_cache_bytes,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "snapshot_bytes": self.snapshot_bytes,
            "num_snapshots": self.cache.num_snapshots if self.cache else None,
            "block_size": self.unit.mla.block_size,
            "block_bytes": self.unit.block_bytes,
            "slot_bytes": self.unit.slot_bytes,
            "kv_bytes_per_token": self.unit.block_bytes // self.unit.mla.block_size,
            "num_blocks": self.cache.num_blocks if self.cache else None,
            "num_slots": self.num_slots,
            "max_tokens_per_request": self.cache.max_tokens_per_request if self.cache else None,
            "max_model_len": self.max_model_len,
            "num_blocks_if_all_left": self.num_blocks_if_all_left,
            "need_bytes": self.need_bytes,
            "fits": self.fits,
            "problems": self.problems(),
            "traffic": None
            if self.traffic is None
            else {
                **vars(self.traffic),
                "allreduce_ring_bytes_per_token": self.traffic.allreduce_ring_bytes_per_token,
            },
        }


def human_bytes(num_bytes: int) -> str:
    """A byte count for people: "91.53 GiB", "256.00 MiB", "7.88 KiB" (negative when short)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:,.2f} {unit}"
    return f"{num_bytes:,} B"


def plan_pool(
    config: ClusterConfig,
    pool: str,
    model: KimiLinearModelConfig,
    *,
    detect_device: bool = True,
    tensor_parallel: int | None = None,
    expert_parallel: bool | None = None,
) -> PoolPlan:
    """The plan of one pool, per rank. `detect_device`: read this machine's device when the config
    gives none. `tensor_parallel` / `expert_parallel` override the pool's (planning a layout before
    the config asks for it); a size the ranks cannot split is a ValueError naming it."""
    section = config.pool(pool)
    tp = tensor_parallel or section.tensor_parallel
    ep = section.expert_parallel if expert_parallel is None else expert_parallel
    ep = ep and tp > 1
    check_splits(model, tp, ep)
    engine = config.engine_config(pool, model_path="<plan>").replace(
        tensor_parallel_size=tp, expert_parallel=ep
    )
    counted = count_weights(model, tp, ep)
    unit = CachePlan.specs(model, block_size=engine.block_size, dtype=engine.dtype, tensor_parallel=tp)
    unit = CachePlan(unit.mla, unit.kda, unit.num_mla_layers, unit.num_kda_layers, 0, engine.max_num_seqs)
    assert engine.kv_cache_memory_bytes is not None  # a pool's budget is always explicit
    cache: CachePlan | None
    try:
        cache, max_model_len = plan_cache(model, engine, engine.kv_cache_memory_bytes)
        error = None
    except ValueError as exc:
        cache, max_model_len, error = None, None, str(exc)
    memory, source = _device_memory(section.device_memory_bytes, engine.device, detect_device)
    if section.device_memory_bytes is None and memory is not None and 0 < section.num_gpus < 1:
        memory, source = int(memory * section.num_gpus), f"{source}, its num_gpus {section.num_gpus:g} share"
    return PoolPlan(
        pool=pool,
        device=engine.device,
        replicas=section.replicas,
        tensor_parallel=tp,
        num_params=counted.num_params,
        weight_bytes=counted.weight_bytes(engine.dtype),
        fused_bytes=counted.fused_bytes(engine.dtype),
        activation=activation_margin(model, engine),
        kv_cache_memory_bytes=engine.kv_cache_memory_bytes,
        unit=unit,
        cache=cache,
        max_model_len=max_model_len,
        cache_error=error,
        device_memory_bytes=memory,
        device_memory_source=source,
        expert_parallel=ep,
        traffic=step_traffic(model, engine.dtype, tp) if tp > 1 else None,
    )


def plan_cluster(
    config: ClusterConfig,
    model: KimiLinearModelConfig,
    *,
    detect_device: bool = True,
    tensor_parallel: int | None = None,
    expert_parallel: bool | None = None,
) -> list[PoolPlan]:
    """One plan per pool that runs (the overrides as for `plan_pool`, to every pool)."""
    return [
        plan_pool(
            config,
            pool,
            model,
            detect_device=detect_device,
            tensor_parallel=tensor_parallel,
            expert_parallel=expert_parallel,
        )
        for pool in config.pool_names
    ]


def _device_memory(configured: int | None, device: str, detect: bool) -> tuple[int | None, str]:
    if configured is not None:
        return configured, "config: device_memory_bytes"
    if not detect:
        return None, "unknown: set device_memory_bytes"
    if device == "cpu":
        return host_memory_bytes(), "this machine's RAM"
    found = visible_gpu_memory_bytes()
    return (found, "the visible GPU") if found is not None else (None, "unknown: no GPU visible here")


def read_model_config(
    config: ClusterConfig, override: str | Path | None = None, shipped: Path | None = None
) -> tuple[KimiLinearModelConfig, str]:
    """The checkpoint's architecture and where it was read from.

    In order: `override` (a config.json or the folder holding one); `model.path`/config.json
    (for the default, the embedded tiny model, built if missing); a config.json shipped under
    `shipped`/<model.path's folder name>/ for a public checkpoint not downloaded here.
    Raises FileNotFoundError saying what to pass when none is found.
    """
    if override is not None:
        path = Path(override).expanduser()
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(
                f"--model-config {override}: no such file (give a config.json or its folder)"
            )
        return KimiLinearModelConfig.from_dict(json.loads(file.read_text(encoding="utf-8"))), str(file)
    folder = Path(config.model.resolved_path())
    if (folder / "config.json").is_file():
        return KimiLinearModelConfig.from_pretrained(folder), str(folder / "config.json")
    known = shipped / folder.name / "config.json" if shipped is not None else None
    if known is not None and known.is_file():
        model = KimiLinearModelConfig.from_dict(json.loads(known.read_text(encoding="utf-8")))
        return model, f"{known} (shipped copy; model.path {config.model.path} has no config.json here)"
    raise FileNotFoundError(
        f"model.path {config.model.path} has no config.json on this machine; pass --model-config "
        "PATH (the checkpoint's config.json, or the folder holding it)"
    )
