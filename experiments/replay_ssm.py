"""Benchmark: KDA decode in ReplaySSM form (checkpoint + ring) against the plain recurrent path.

    python -m experiments.replay_ssm [--window 16] [--rows 8] [--steps 64] [--threads 1]

Prints three tables:
1. the KDA delta-rule decode step alone (one layer, `--rows` slots), plain (`kda_decode_into`) and
   ring (`ReplayLayerRing.step`, folds included), for the tiny preset's head shape and the 48B
   model's (32 heads x 128), on whatever backend this machine selects (torch on a CPU);
2. a whole engine's decode step on the tiny preset, `replay_window` 0 against `--window`;
3. bytes a decode worker publishes per generated token (records + conv + MLA rows, every window)
   against publishing the checkpoint every window instead, for the tiny preset and the 48B config
   in deploy/configs/models/ (arithmetic on the configs; nothing is run).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.cache_spec import FP32_BYTES, CachePlan
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.ops.kda import l2norm
from splitserve.engine.ops.kda_dispatch import kda_decode_into
from splitserve.engine.replay_ring import ReplayRing
from splitserve.engine_config import DTYPE_BYTES
from splitserve.tiny_model import make_tiny_model

MODEL_48B = Path(__file__).resolve().parents[1] / "deploy/configs/models/Kimi-Linear-48B-A3B-Instruct"


def op_step_ms(
    heads: int, head_dim: int, rows: int, window: int, steps: int, device: str
) -> tuple[float, float]:
    """Mean ms per decode step of one KDA layer: (plain, ring)."""
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(rows + 2, heads, head_dim, head_dim, generator=gen).to(device)
    slots = list(range(1, rows + 1))
    index = torch.tensor(slots, device=device)
    inputs = []
    for _ in range(steps):
        q = l2norm(torch.randn(rows, heads, head_dim, generator=gen)) * head_dim**-0.5
        k = l2norm(torch.randn(rows, heads, head_dim, generator=gen))
        v = torch.randn(rows, heads, head_dim, generator=gen)
        g = -torch.rand(rows, heads, head_dim, generator=gen)
        beta = torch.rand(rows, heads, generator=gen)
        inputs.append(tuple(t.to(device) for t in (q, k, v, g, beta)))

    def timed(step) -> float:  # type: ignore[no-untyped-def]
        step(*inputs[0])  # warm up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for x in inputs:
            step(*x)
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / len(inputs) * 1e3

    plain_pool = pool.clone()
    plain = timed(lambda q, k, v, g, b: kda_decode_into(q, k, v, g, b, plain_pool, index))
    ring = ReplayRing.allocate({0: pool.clone()}, window, device).layers[0]

    def replay_step(q, k, v, g, b):  # type: ignore[no-untyped-def]
        counts = torch.tensor([ring.counts[s] for s in slots], device=device)
        return ring.step(q, k, v, g, b, index, counts, slots)

    replay = timed(replay_step)
    return plain, replay


def engine_step_ms(path: Path, window: int, rows: int, new_tokens: int) -> float:
    """Mean ms per engine step while `rows` requests decode (prompts of 8 tokens; prefill excluded)."""
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, replay_window=window)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(rows):
        engine.add_request(str(i), [5 + i, 6, 7, 8, 9, 10, 11, 12], params)
    engine.step()  # the prompts' step
    num_steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests:
        engine.step()
        num_steps += 1
    return (time.perf_counter() - start) / max(1, num_steps) * 1e3


def published_bytes_per_token(config: KimiLinearModelConfig, dtype: str, window: int) -> dict[str, float]:
    """Per generated token: what a publish every `window` tokens costs, records vs checkpoints."""
    unit = CachePlan.specs(config, block_size=16, dtype=dtype)
    kda, n_kda, n_mla = unit.kda, unit.num_kda_layers, unit.num_mla_layers
    records = n_kda * kda.num_heads * (2 * kda.head_k_dim + kda.head_v_dim) * FP32_BYTES  # per token
    conv = n_kda * kda.conv_dim * kda.conv_len * DTYPE_BYTES[dtype] / window
    checkpoint = n_kda * kda.num_heads * kda.head_k_dim * kda.head_v_dim * FP32_BYTES / window
    mla = n_mla * unit.mla.entry_dim * DTYPE_BYTES[dtype]
    return {
        "records": records + conv + mla,
        "checkpoint": checkpoint + conv + mla,
        "mla_rows": mla,
        "whole_state_at_4k": 4096 * mla + n_kda * kda.slot_size_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny_path = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    tiny = KimiLinearModelConfig.from_pretrained(tiny_path)
    big = KimiLinearModelConfig.from_pretrained(MODEL_48B)

    print(
        f"1. one KDA layer's decode step, {args.rows} rows, window {args.window}, {device}, {args.threads} thread(s)"
    )
    print(f"{'shape':>22} {'plain ms':>9} {'ring ms':>9} {'ring/plain':>10}")
    for name, cfg in (("tiny", tiny), ("48B (32 x 128)", big)):
        plain, ring = op_step_ms(
            cfg.linear_num_heads, cfg.linear_head_dim, args.rows, args.window, args.steps, device
        )
        shape = f"{name} {cfg.linear_num_heads}x{cfg.linear_head_dim}"
        print(f"{shape:>22} {plain:9.3f} {ring:9.3f} {ring / plain:10.2f}")

    print(f"\n2. tiny preset engine decode step, {args.rows} requests x {args.new_tokens} tokens")
    plain_ms = engine_step_ms(tiny_path, 0, args.rows, args.new_tokens)
    ring_ms = engine_step_ms(tiny_path, args.window, args.rows, args.new_tokens)
    print(f"plain {plain_ms:.2f} ms/step, ring {ring_ms:.2f} ms/step, ring/plain {ring_ms / plain_ms:.2f}")

    print(f"\n3. bytes published per generated token (every {args.window} tokens)")
    print(
        f"{'model':>8} {'records':>12} {'checkpoint':>12} {'of which MLA':>13} {'ratio':>6} {'state@4k':>12}"
    )
    for name, cfg, dtype in (("tiny", tiny, "float32"), ("48B", big, "bfloat16")):
        b = published_bytes_per_token(cfg, dtype, args.window)
        ratio = b["checkpoint"] / b["records"]
        print(
            f"{name:>8} {b['records']:12,.0f} {b['checkpoint']:12,.0f} {b['mla_rows']:13,.0f} {ratio:6.1f} "
            f"{b['whole_state_at_4k']:12,.0f}"
        )


if __name__ == "__main__":
    main()
