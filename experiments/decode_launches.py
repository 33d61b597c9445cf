"""Kernel launches per decode step on the CUDA code path, counted on this CPU.

    python -m experiments.decode_launches [--model 1b|48b|tiny] [--batch-sizes 1,64] [--context 512]
                                          [--replay-window 16]

The model (`--model 1b`: experiments/gpu_throughput.py's ~1B shape; `48b`: Kimi-Linear-48B's config;
`tiny`: the test preset) is built with fake weights (FakeTensorMode: shapes only, nothing computed,
and a host sync would raise), every kernel backend is forced to its CUDA choice (Triton for paged MLA,
the fused MoE and the fused glue; fla's KDA recurrence), each Triton or fla launch is stubbed and
counted as one (experiments/launch_counter.py), and
one greedy decode step of `batch` rows at `context` tokens each runs: the runner's batch build after
its host-to-device copy, the forward, the logits and the sampler. Every other dispatched aten op
that is not a view or a bare allocation counts as one launch. Printed: launches per step, per layer,
and per layer type broken down by module. Nothing here needs a GPU, and nothing here ran on one:
a count is what the eager engine would launch, and what a CUDA graph of the step would hold.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.gpu_throughput import MODEL_1B
from experiments.launch_counter import (
    RUNNER,
    SAMPLER,
    Launch,
    LaunchCounter,
    count_host_reads,
    cuda_code_path,
    runner_copy,
)
from splitserve import SamplingParams
from splitserve.engine.cache_pool import allocate_caches
from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.loader import materialize
from splitserve.engine.model.kimi_linear import KimiLinearForCausalLM, LayerCaches
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.replay_ring import ReplayRing
from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler, SamplingRow
from splitserve.engine.scheduler import ScheduledRequest
from splitserve.tiny_model import PRESETS

MODEL_48B = Path(__file__).resolve().parents[1] / "deploy/configs/models/Kimi-Linear-48B-A3B-Instruct"
BLOCK_SIZE = 16
VOCAB_SIZE = 32_000  # the count does not depend on it
GREEDY = SamplingParams(temperature=0.0)  # what gpu_throughput measures


def model_config(name: str) -> KimiLinearModelConfig:
    """The config of `--model`: `1b` (gpu_throughput's), `48b` (Kimi-Linear-48B) or `tiny`."""
    if name == "48b":
        return KimiLinearModelConfig.from_dict(json.loads((MODEL_48B / "config.json").read_text()))
    if name == "1b":
        raw = {**PRESETS["bench-10m"], **MODEL_1B}
    elif name == "tiny":
        raw = dict(PRESETS["tiny"])
    else:
        raise ValueError(f"--model {name!r}: choose 1b, 48b or tiny")
    return KimiLinearModelConfig.from_dict({**raw, "vocab_size": VOCAB_SIZE})


@dataclasses.dataclass
class StepCount:
    """One decode step's launches: per (scope, op), and the model's layer kinds."""

    config: KimiLinearModelConfig
    batch_size: int
    counts: Counter[tuple[str, str]]
    launched: list[Launch]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def per_layer(self) -> list[int]:
        layers = [0] * self.config.num_hidden_layers
        for (scope, _), n in self.counts.items():
            layer = layer_of(scope)
            if layer is not None:
                layers[layer] += n
        return layers

    def outside_layers(self) -> Counter[str]:
        """Launches outside the decoder layers: the runner's (embedding and final norm included), the sampler's."""
        outside: Counter[str] = Counter({RUNNER: 0, SAMPLER: 0})
        for (scope, _), n in self.counts.items():
            if layer_of(scope) is None:
                outside[SAMPLER if scope == SAMPLER else RUNNER] += n
        return outside


def layer_of(scope: str) -> int | None:
    """The decoder layer a scope belongs to (`model.layers.3.self_attn` -> 3), None outside them."""
    parts = scope.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


def _requests(batch_size: int, context: int) -> list[ScheduledRequest]:
    """`batch_size` decode rows, each with `context` tokens before the one it decodes."""
    blocks = -(-(context + 1) // BLOCK_SIZE)
    scheduled = []
    for i in range(batch_size):
        request = Request(f"r{i}", [1 + (i + j) % 100 for j in range(context + 1)], GREEDY, 1, i)
        request.num_computed_tokens, request.state_slot = context, i
        request.block_table = list(range(i * blocks, (i + 1) * blocks))
        scheduled.append(ScheduledRequest(request, 1))
    return scheduled


def build_fake_model(
    config: KimiLinearModelConfig, num_slots: int, context: int
) -> tuple[KimiLinearForCausalLM, LayerCaches]:
    """The model in bf16 and caches for `num_slots` rows of `context` tokens, as fake tensors (call
    inside a FakeTensorMode): shapes and dtypes, no memory and nothing computed."""
    with torch.device("meta"):
        model = KimiLinearForCausalLM(config)
    materialize(model, torch.bfloat16, torch.device("cpu"))
    model.finalize()
    plan = CachePlan.specs(config, block_size=BLOCK_SIZE, dtype="bfloat16")
    blocks = -(-(context + 1) // BLOCK_SIZE)
    plan = dataclasses.replace(plan, num_blocks=num_slots * blocks, num_slots=num_slots)
    return model, allocate_caches(plan, config, "cpu")


def count_decode_step(
    config: KimiLinearModelConfig, batch_size: int, context: int = 512, replay_window: int = 0
) -> StepCount:
    """Launches of one greedy decode step of `batch_size` rows on the CUDA code path (see the module
    doc); with `replay_window`, KDA decodes in ReplaySSM form (its ring kernel)."""
    counter = LaunchCounter()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with cuda_code_path(counter), torch.inference_mode():
        with fake:
            model, caches = build_fake_model(config, batch_size, context)
            if replay_window:
                caches.replay = ReplayRing.allocate(caches.kda_recurrent, replay_window, "cpu")
        counter.track_modules(model)
        runner = ModelRunner(model, caches, Sampler(1, ()), BLOCK_SIZE, torch.device("cpu"))
        scheduled = _requests(batch_size, context)
        # the batch's host side is host work; what follows its one host-to-device copy runs on the device
        with mock.patch("splitserve.engine.host_pack.HostPack.to", runner_copy(counter)), counter:
            batch = runner.build_batch(scheduled, [])
        with fake, counter:
            logits = model.compute_logits(model(batch, caches))
    real_logits = torch.zeros(logits.shape, dtype=logits.dtype)  # the sampler runs on real CPU tensors
    rows = [SamplingRow(s.request.params, s.request.prompt_token_ids, []) for s in scheduled]
    sampler = Sampler(config.vocab_size, config.eos_token_ids)
    with torch.inference_mode(), counter, counter.scope(SAMPLER), count_host_reads(counter):
        sampler(real_logits, rows)
    counter.enabled = False
    return StepCount(config, batch_size, counter.counts, counter.launched)


def module_kind(model_path: str, config: KimiLinearModelConfig) -> str:
    """A short name for the part of a layer a scope is in: `residual+norm`, `attention` (KDA / MLA),
    `attention_norm`, `gated_norm`, `router`, `experts`, `shared_experts`, `moe` (what the MoE block runs
    itself: the fused experts, shared ones included, or the sum of the two), `mlp` (dense)."""
    parts = model_path.split(".")[3:]  # below model.layers.N
    if not parts or parts[0] in ("input_layernorm", "post_attention_layernorm"):
        return "residual+norm"  # the layer's own ops are its residual adds, fused with the norms after them
    head = parts[0]
    if head == "self_attn":
        if parts[1:2] == ["o_norm"]:
            return "gated_norm"
        if parts[1:2] in (["kv_a_layernorm"], ["q_a_layernorm"]):
            return "attention_norm"
        return "attention"
    if head == "block_sparse_moe":
        if not _is_sparse(model_path, config):
            return "mlp"
        names = {"gate": "router", "experts": "experts", "shared_experts": "shared_experts"}
        return names.get(parts[1], "moe") if len(parts) > 1 else "moe"
    return head


def _is_sparse(scope: str, config: KimiLinearModelConfig) -> bool:
    layer = layer_of(scope)
    return layer is not None and config.mlp_layer_types[layer] == "sparse"


def layer_type(config: KimiLinearModelConfig, layer: int) -> str:
    attn = "MLA" if config.layer_types[layer] == "full_attention" else "KDA"
    return f"{attn}+{'MoE' if config.mlp_layer_types[layer] == 'sparse' else 'dense'}"


def breakdown(step: StepCount) -> dict[str, Counter[str]]:
    """Per layer type (e.g. `KDA+MoE`), launches per layer of that type by module kind."""
    kinds: dict[str, Counter[str]] = {}
    num_layers: Counter[str] = Counter(
        layer_type(step.config, i) for i in range(step.config.num_hidden_layers)
    )
    for (scope, _), n in step.counts.items():
        layer = layer_of(scope)
        if layer is not None:
            kinds.setdefault(layer_type(step.config, layer), Counter())[module_kind(scope, step.config)] += n
    return {t: Counter({k: v / num_layers[t] for k, v in c.items()}) for t, c in sorted(kinds.items())}


KIND_ORDER = ["residual+norm", "attention", "attention_norm", "gated_norm", "router", "experts"]
KIND_ORDER += ["shared_experts", "moe", "mlp"]


def report(step: StepCount, verbose: bool = False) -> str:
    """The step's total, each layer's count, and a table: launches per layer of each type, by module kind."""
    per_layer = step.per_layer()
    outside = step.outside_layers()
    lines = [
        f"batch {step.batch_size}: {step.total:,} launches per decode step: {sum(per_layer):,} in the "
        f"{len(per_layer)} layers (max {max(per_layer)}, mean {sum(per_layer) / len(per_layer):.1f} per layer), "
        f"runner {outside[RUNNER]}, sampler {outside[SAMPLER]}",
        "  per layer: " + " ".join(f"{i}:{layer_type(step.config, i)}={n}" for i, n in enumerate(per_layer)),
    ]
    table = breakdown(step)
    kinds = [k for k in KIND_ORDER if any(k in parts for parts in table.values())]
    kinds += sorted({k for parts in table.values() for k in parts} - set(kinds))
    header = ["launches per layer", *table]
    rows = [[kind, *(f"{table[t][kind]:g}" for t in table)] for kind in kinds]
    rows.append(["total", *(f"{sum(parts.values()):g}" for parts in table.values())])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append(
            "  "
            + "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))
            )
        )
    if verbose:
        for (scope, op), n in sorted(step.counts.items()):
            lines.append(f"    {n:4d}  {scope:45s} {op}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1b", choices=["1b", "48b", "tiny"])
    parser.add_argument("--batch-sizes", default="1,64", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=512, help="tokens before the decoded one, per row")
    parser.add_argument("--replay-window", type=int, default=0, help="KDA decode in ReplaySSM form (0: off)")
    parser.add_argument("--verbose", action="store_true", help="every (module, op) count")
    args = parser.parse_args(argv)
    config = model_config(args.model)
    print(
        f"model {args.model}: {config.num_hidden_layers} layers ({len(config.kda_layer_ids)} KDA, "
        f"{len(config.mla_layer_ids)} MLA), context {args.context}, replay window {args.replay_window}; "
        "CUDA code path, launches counted on the CPU"
    )
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        step = count_decode_step(config, batch_size, args.context, args.replay_window)
        print(report(step, args.verbose))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
