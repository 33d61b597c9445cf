"""`splitserve demo`: an offline generation on the embedded default model (or `--model PATH`).

Stands in for `splitserve up` until the cluster lands: it proves the install, builds the tiny
model on first use, and prints a few completions and the engine's throughput.
"""

from __future__ import annotations

import argparse
import time

DEMO_PROMPTS = [
    "The capital of a small country",
    "Once upon a time, in a quiet village,",
    "A recipe for bread needs",
    "The best way to learn programming is",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded tiny model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    from splitserve import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="float32")
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i)
        for i in range(len(DEMO_PROMPTS))
    ]
    start = time.perf_counter()
    outputs = llm.generate(DEMO_PROMPTS, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tok/s); model: {llm.engine.config.model}"
    )
    return 0
