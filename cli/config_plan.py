"""`splitserve config plan FILE`: each pool's memory plan as a table (or JSON), before anything starts.

Every figure is one device's, which is one rank's under tensor parallelism (`--tensor-parallel N`
[--expert-parallel] plans a layout the config does not ask for yet), with what a step sends
between a replica's ranks.

Exit status: 0 every pool fits, 1 one does not (or the config or model config cannot be read),
3 some pool's device memory is unknown here (set `<pool>.device_memory_bytes`). Torch-free
unless a GPU pool without `device_memory_bytes` asks torch for the visible device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from splitserve.memory_plan import PoolPlan, human_bytes

# config.json copies of public checkpoints, by folder name, for planning before a download
SHIPPED_MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "models"

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_UNKNOWN = 0, 1, 3


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the cluster config YAML to plan")
    parser.add_argument(
        "--model-config",
        default=None,
        metavar="PATH",
        help="the checkpoint's config.json (or its folder); default: model.path's, else a shipped copy "
        "for the checkpoint of that folder name",
    )
    parser.add_argument("--json", action="store_true", help="print the plans as JSON")
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="N",
        help="plan every pool with N ranks (devices) per replica instead of its tensor_parallel",
    )
    parser.add_argument(
        "--expert-parallel",
        action="store_true",
        help="with --tensor-parallel: spread the routed experts over the ranks whole",
    )


def run_plan(args: argparse.Namespace) -> int:
    from splitserve.config import ConfigError, load_config
    from splitserve.memory_plan import plan_cluster, read_model_config

    try:
        config = load_config(args.file)
        model, source = read_model_config(config, args.model_config, SHIPPED_MODEL_CONFIGS)
        layout = {"tensor_parallel": args.tensor_parallel, "expert_parallel": args.expert_parallel or None}
        plans = plan_cluster(config, model, **layout)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"splitserve config plan: {exc}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if args.json:
        print(
            json.dumps(
                {"config": args.file, "model_config": source, "pools": [p.to_dict() for p in plans]}, indent=2
            )
        )
    else:
        print(plan_table(args.file, source, config.model.dtype, plans))
    return exit_status(plans)


def exit_status(plans: list[PoolPlan]) -> int:
    if any(plan.fits is False for plan in plans):
        return EXIT_DOES_NOT_FIT
    return EXIT_UNKNOWN if any(plan.fits is None for plan in plans) else EXIT_FITS


def plan_table(file: str, source: str, dtype: str, plans: list[PoolPlan]) -> str:
    """The plans side by side, one column per pool, then a verdict line per pool."""
    first = plans[0]
    kda_layers, mla_layers = first.unit.num_kda_layers, first.unit.num_mla_layers
    rank = f" per rank of {first.tensor_parallel} ({first.pool})" if first.tensor_parallel > 1 else ""
    head = [
        f"memory plan for {file}",
        f"model config: {source}",
        f"  {first.num_params / 1e9:,.2f} B parameters{rank} in {dtype} (router weights, their bias and "
        "KDA dt_bias in fp32)",
        f"  per request{rank}: {human_bytes(first.unit.slot_bytes)} of KDA state ({kda_layers} layers), "
        f"{human_bytes(first.unit.block_bytes // first.unit.mla.block_size)} of MLA KV per token "
        f"({mla_layers} layers)",
        "",
    ]
    rows = [("", [f"{p.pool}" for p in plans])] + [(label, [cell(p) for p in plans]) for label, cell in _ROWS]
    width = max(len(label) for label, _ in rows) + 2
    columns = [max(len(values[i]) for _, values in rows) + 3 for i in range(len(plans))]
    lines = [
        label.ljust(width) + "".join(v.ljust(columns[i]) for i, v in enumerate(values)).rstrip()
        for label, values in rows
    ]
    return "\n".join(head + lines + [""] + [_verdict(p) for p in plans])


def _device(plan: PoolPlan) -> str:
    tp = f", tensor_parallel {plan.tensor_parallel}" if plan.tensor_parallel > 1 else ""
    ep = ", expert_parallel" if plan.expert_parallel else ""
    # on GPUs every rank reserves one of its own (a fraction is refused with tensor_parallel)
    gpus = f" ({plan.replicas * plan.tensor_parallel} GPUs)" if plan.device == "cuda" and tp else ""
    return f"{plan.device}, {plan.replicas} replica{'s' if plan.replicas != 1 else ''}{tp}{ep}{gpus}"


def _allreduce(plan: PoolPlan) -> str:
    t = plan.traffic
    if t is None:
        return "-"
    per_call = t.allreduce_payload_bytes_per_token // t.num_allreduces
    return f"{t.num_allreduces} x {human_bytes(per_call)} (ring: {human_bytes(t.allreduce_ring_bytes_per_token)} per rank)"


def _gather(plan: PoolPlan) -> str:
    t = plan.traffic
    return "-" if t is None else f"{human_bytes(t.logits_gather_bytes_per_row)} into rank 0"


def _memory(plan: PoolPlan) -> str:
    if plan.device_memory_bytes is None:
        return "unknown"
    return human_bytes(plan.device_memory_bytes)


def _left(plan: PoolPlan) -> str:
    left = plan.left_for_cache_bytes
    return "unknown" if left is None else human_bytes(left)


def _slots(plan: PoolPlan) -> str:
    return f"{plan.num_slots:,} ({human_bytes(plan.num_slots * plan.unit.slot_bytes)})"


def _blocks(plan: PoolPlan) -> str:
    if plan.cache is None:
        return "none: budget too small"
    return f"{plan.cache.num_blocks:,} x {plan.unit.mla.block_size} tokens ({human_bytes(plan.cache.num_blocks * plan.unit.block_bytes)})"


def _snapshots(plan: PoolPlan) -> str:
    if plan.cache is None or not plan.snapshot_bytes:
        return "none"
    return f"{plan.cache.num_snapshots:,} ({human_bytes(plan.snapshot_bytes)})"


def _longest(plan: PoolPlan) -> str:
    return "-" if plan.max_model_len is None else f"{plan.max_model_len:,} tokens"


def _one_request(plan: PoolPlan) -> str:
    return "-" if plan.cache is None else f"{plan.cache.max_tokens_per_request:,} tokens"


def _all_left(plan: PoolPlan) -> str:
    blocks = plan.num_blocks_if_all_left
    return (
        "unknown" if blocks is None else f"{blocks:,} blocks ({blocks * plan.unit.mla.block_size:,} tokens)"
    )


def _fits(plan: PoolPlan) -> str:
    return {True: "YES", False: "NO", None: "UNKNOWN"}[plan.fits]


_ROWS = (
    ("device", _device),
    ("device memory", _memory),
    ("  from", lambda p: p.device_memory_source),
    ("weights (per rank)", lambda p: human_bytes(p.weight_bytes)),
    ("fused copies (built at load)", lambda p: human_bytes(p.fused_bytes)),
    ("activation margin", lambda p: human_bytes(p.activation.total_bytes)),
    (
        "  per batched token",
        lambda p: f"{p.activation.bytes_per_token / 2**10:,.0f} KiB x {p.activation.num_batched_tokens:,}",
    ),
    (
        "  + logits, CUDA runtime",
        lambda p: f"{human_bytes(p.activation.logits_bytes)} + {human_bytes(p.activation.runtime_bytes)}",
    ),
    ("left for KV blocks + state", _left),
    ("kv_cache_memory_bytes", lambda p: human_bytes(p.kv_cache_memory_bytes)),
    ("  state slots (max_num_seqs)", _slots),
    ("  KV blocks", _blocks),
    ("prefix snapshots (beside it)", _snapshots),
    ("longest request served", _longest),
    ("  one request, all blocks", _one_request),
    ("KV if the budget took all left", _all_left),
    ("needs per device", lambda p: human_bytes(p.need_bytes)),
    ("between ranks, per token", _allreduce),
    ("  logits per sampled row", _gather),
    ("fits", _fits),
)


def _verdict(plan: PoolPlan) -> str:
    if plan.fits:
        spare = (plan.left_for_cache_bytes or 0) - plan.kv_cache_memory_bytes - plan.snapshot_bytes
        return f"{plan.pool}: fits, {human_bytes(spare)} spare per device"
    if plan.fits is None:
        return (
            f"{plan.pool}: UNKNOWN whether it fits ({plan.device_memory_source}); set "
            f"{plan.pool}.device_memory_bytes (one device's memory)"
        )
    return "\n".join(plan.problems())
