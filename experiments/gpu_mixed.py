"""Mixed steps on one GPU: the inter-token latency of running decodes while a long prompt prefills.

    python -m experiments.gpu_mixed [--decodes 16] [--prompt 32768] [--chunk 2048] [--steps 16]
    python -m experiments.gpu_mixed --device cpu --tiny        # the CPU smoke mode the tests run

One engine (the ~1B random kimi_linear in bf16, CUDA graphs on) runs `--decodes` requests with short
prompts until all of them decode, times `--steps` decode-only steps, then takes a `--prompt`-token
prompt: while it prefills in chunks of `--chunk` tokens minus the decodes' (one token per running
decode shares each step's budget), every step also gives each decode its next token. Each step's wall
time is one inter-token latency (ITL) of every running decode (the sampled ids come back to the
host at the end of a step). Printed: ITL before, during and after the prefill (median, 90th
percentile, largest) and the prompt's time to its first token. Figures only: no assertion on time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from experiments.gpu_common import (
    check_device,
    checkpoint,
    load_engine,
    model_dtype,
    print_table,
    stage_parser,
    synchronize,
    write_figures,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = stage_parser(__doc__)
    parser.add_argument("--decodes", type=int, default=None, help="running decodes (default 16; tiny: 2)")
    parser.add_argument("--prompt", type=int, default=None, help="the long prompt's tokens (default 32768)")
    parser.add_argument(
        "--chunk", type=int, default=None, help="max_num_batched_tokens (default 2048; tiny: 32)"
    )
    parser.add_argument("--steps", type=int, default=None, help="decode-only steps timed before and after")
    args = parser.parse_args(argv)
    args.decodes = args.decodes or (2 if args.tiny else 16)
    args.prompt = args.prompt or (96 if args.tiny else 32768)
    args.chunk = args.chunk or (32 if args.tiny else 2048)
    args.steps = args.steps or (2 if args.tiny else 16)
    args.dtype = model_dtype(args.device)
    return args


def latency(samples_s: list[float]) -> dict[str, float]:
    """Median, 90th percentile and largest of step times (seconds)."""
    ordered = sorted(samples_s)
    return {
        "median_s": statistics.median(ordered),
        "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max_s": ordered[-1],
        "steps": len(ordered),
    }


def timed_step(engine: Any, device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    engine.step()
    synchronize(device)
    return time.perf_counter() - start


def measure(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The three phases (see the module doc); their ITLs and the prompt's time to its first token."""
    from splitserve import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    num_prefill_steps = -(-args.prompt // max(1, args.chunk - args.decodes))
    budget = SamplingParams(temperature=0, max_tokens=2 * args.steps + num_prefill_steps + 8, ignore_eos=True)
    decodes = [
        engine.add_request(f"decode-{i}", torch.randint(3, vocab, (64,), generator=gen).tolist(), budget)
        for i in range(args.decodes)
    ]
    while not all(r.output_token_ids for r in decodes):
        engine.step()
    before = [timed_step(engine, args.device) for _ in range(args.steps)]
    ids = torch.randint(3, vocab, (args.prompt,), generator=gen).tolist()
    long = engine.add_request("long", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    start_s, during = time.perf_counter(), []
    while not long.output_token_ids:
        during.append(timed_step(engine, args.device))
    ttft_s = time.perf_counter() - start_s
    after = [timed_step(engine, args.device) for _ in range(args.steps)]
    for r in decodes:
        engine.abort_request(r.request_id)
    return {
        "decodes": args.decodes,
        "prompt": args.prompt,
        "chunk": args.chunk,
        "itl_before": latency(before),
        "itl_during": latency(during),
        "itl_after": latency(after),
        "prompt_ttft_s": ttft_s,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_device(args.device)
    with tempfile.TemporaryDirectory() as scratch:
        path = checkpoint(args.model_dir, args.tiny, Path(scratch))
        llm, _ = load_engine(
            args,
            path,
            max_num_seqs=args.decodes + 1,
            max_num_batched_tokens=args.chunk,
            max_model_len=args.prompt + 64,
        )
        result = measure(llm, args)
    phases = ("before", "during", "after")
    rows = [
        [phase, *(f"{result[f'itl_{phase}'][k] * 1e3:,.1f}" for k in ("median_s", "p90_s", "max_s"))]
        for phase in phases
    ]
    rows = [[*row, str(result[f"itl_{phase}"]["steps"])] for row, phase in zip(rows, phases)]
    print_table(
        f"ITL of {args.decodes} running decodes around a {args.prompt:,}-token prefill (chunks of {args.chunk})",
        ["phase", "median ms", "p90 ms", "max ms", "steps"],
        rows,
    )
    print(f"the long prompt's first token after {result['prompt_ttft_s']:.2f} s")
    ratio = result["itl_during"]["median_s"] / result["itl_before"]["median_s"]
    summary = (
        f"ITL {result['itl_before']['median_s'] * 1e3:.1f} ms before, "
        f"{result['itl_during']['median_s'] * 1e3:.1f} ms during the prefill ({ratio:.1f}x)"
    )
    write_figures(args.json, summary, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
