"""Benchmark: swap preemption against recompute preemption on a preemption-heavy workload.

    python -m experiments.swap_preemption [--requests 8] [--prompt-tokens 2048] [--max-tokens 64]
        [--growth-fit 0.25] [--threads 2] [--repeats 1] [--prefix-caching]
        [--model PATH] [--no-store]

`--requests` greedy requests of `--prompt-tokens` random tokens each, all submitted at once, on
one engine whose KV budget holds every prompt but only `--growth-fit` of the tokens they go on to
generate: all are admitted, and as they decode they run out of blocks and preempt each other
(the newest first), each preemption hitting a request that is decoding. The same workload runs, one engine each, side by side in this process:

* `recompute`: a preempted request's state is freed and its prompt + outputs computed again;
* `swap (host)`: its state is copied to host memory and back (`preemption_mode="swap"`);
* `swap (store)`: its state goes to a state store server on 127.0.0.1 and back, as a cluster's
  decode worker does (decode_worker/swap_space.py); `--no-store` leaves it out.

Prints one row per mode: total seconds (the median of `--repeats` runs, each repeat running the
modes in a rotated order, so a busy machine's drift falls on every mode), generated tokens per
second, engine steps, preemptions, swaps out / in, recompute fallbacks, MiB swapped out, tokens
the engine computed (prompts + outputs, each recompute counted again) and whether the tokens
equal the recompute run's. Tiny preset by default
(built into a temp folder); `--model` runs a checkpoint instead. `--prefix-caching` turns the
engine's prefix cache on in every mode (as a cluster runs): a recomputed request may then hit
the KV and snapshot its own prompt left, where they survived the pressure.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from decode_worker.swap_space import StoreSwapSpace
from splitserve import LLM, SamplingParams
from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.state.client import StateStoreClient
from splitserve.tiny_model import make_tiny_model
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore

BLOCK_SIZE = 16


@dataclass
class ModeResult:
    name: str
    total_s: list[float]
    num_generated: int
    num_preemptions: int
    num_swapped_out: int
    num_swapped_in: int
    num_fallbacks: int
    swap_out_bytes: int
    num_computed_tokens: int
    num_steps: int
    tokens: list[list[int]]


def engine_kwargs(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """A KV budget of every prompt and `--growth-fit` of the outputs (at least one whole request)."""
    config = KimiLinearModelConfig.from_pretrained(model)
    unit = CachePlan.specs(config, block_size=BLOCK_SIZE, dtype="float32")
    prompt_blocks = -(-(args.prompt_tokens + 1) // BLOCK_SIZE)
    growth_blocks = int(args.requests * args.max_tokens * args.growth_fit) // BLOCK_SIZE
    whole = -(-(args.prompt_tokens + args.max_tokens) // BLOCK_SIZE)
    num_blocks = max(args.requests * prompt_blocks + growth_blocks, whole + 1)
    return dict(
        dtype="float32",
        num_threads=args.threads,
        block_size=BLOCK_SIZE,
        max_num_seqs=args.requests,
        max_num_batched_tokens=args.prompt_tokens,
        max_model_len=args.prompt_tokens + args.max_tokens + 1,
        kv_cache_memory_bytes=args.requests * unit.slot_room_bytes + num_blocks * unit.block_bytes,
        enable_prefix_caching=args.prefix_caching,
        prefix_unit=64,
    )


def count_computed(engine: LLMEngine) -> Callable[[], tuple[int, int]]:
    """Count the steps and the tokens they compute (a recomputed token counts each time)."""
    total = [0, 0]
    execute = engine.runner.execute

    def counted(scheduled, *rest):  # type: ignore[no-untyped-def]
        total[0] += sum(s.num_new_tokens for s in scheduled)
        total[1] += 1
        return execute(scheduled, *rest)

    engine.runner.execute = counted  # type: ignore[method-assign]
    return lambda: (total[0], total[1])


def run_mode(
    name: str, model: str, prompts: list[list[int]], args: argparse.Namespace, **extra: Any
) -> ModeResult:
    space = extra.pop("space", None)
    llm = LLM(model=model, **engine_kwargs(model, args), **extra)
    if space is not None:
        llm.engine.set_swap_space(space)
    llm.generate(prompt_token_ids=[prompts[0][:32]], sampling_params=SamplingParams(max_tokens=2))  # warm
    computed = count_computed(llm.engine)
    before = llm.engine.scheduler.num_preemptions
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    total_s = time.perf_counter() - start
    stats = llm.engine.swap_stats()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return ModeResult(
        name,
        [total_s],
        sum(len(t) for t in tokens),
        llm.engine.scheduler.num_preemptions - before,
        stats.num_swapped_out,
        stats.num_swapped_in,
        stats.num_recompute_fallbacks,
        stats.num_swap_out_bytes,
        *computed(),
        tokens,
    )


@contextlib.contextmanager
def store_server() -> Iterator[str]:
    store = StateStore.from_config(StoreConfig(memory_bytes=4 << 30))
    server = StateStoreServer(store, "127.0.0.1", 0)
    try:
        yield server.address
    finally:
        server.stop(grace_s=0)
        store.close()


def main(argv: list[str] | None = None) -> list[ModeResult]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--growth-fit", type=float, default=0.25, help="share of the generated tokens the KV budget holds"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode (the median is shown)")
    parser.add_argument("--prefix-caching", action="store_true", help="the prefix cache on in every mode")
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the tiny preset)")
    parser.add_argument("--no-store", action="store_true", help="leave out the store-backed swap")
    args = parser.parse_args(argv)
    model = args.model or str(make_tiny_model(tempfile.mkdtemp(prefix="swap-bench-"), seed=0))
    vocab = KimiLinearModelConfig.from_pretrained(model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    modes: list[tuple[str, dict[str, Any]]] = [
        ("recompute", {}),
        ("swap (host)", {"preemption_mode": "swap"}),
    ]
    with contextlib.ExitStack() as stack:
        if not args.no_store:
            client = stack.enter_context(StateStoreClient(stack.enter_context(store_server())))
            modes.append(
                ("swap (store)", {"preemption_mode": "swap", "space": StoreSwapSpace(client, "bench")})
            )
        by_name: dict[str, ModeResult] = {}
        for repeat in range(args.repeats):
            for name, extra in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
                result = run_mode(name, model, prompts, args, **dict(extra))
                if name in by_name:
                    by_name[name].total_s += result.total_s
                else:
                    by_name[name] = result
    results = [by_name[name] for name, _ in modes]
    print(
        f"{args.requests} requests x {args.prompt_tokens} prompt tokens, {args.max_tokens} generated each, "
        f"KV budget: every prompt + {args.growth_fit:.0%} of the outputs, {args.threads} threads, "
        f"prefix caching {'on' if args.prefix_caching else 'off'}"
    )
    print(
        "| mode | total s | gen tok/s | steps | preemptions | swapped out / in | fallbacks | MiB out | "
        "computed | same |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        same = "yes" if r.tokens == results[0].tokens else "NO"
        total_s = statistics.median(r.total_s)
        print(
            f"| {r.name} | {total_s:.2f} | {r.num_generated / total_s:.1f} | {r.num_steps} | {r.num_preemptions} | "
            f"{r.num_swapped_out} / {r.num_swapped_in} | {r.num_fallbacks} | {r.swap_out_bytes / 2**20:.1f} | "
            f"{r.num_computed_tokens:,} | {same} |"
        )
    if args.repeats > 1:
        print(
            "runs (s): " + "; ".join(f"{r.name} " + ", ".join(f"{t:.1f}" for t in r.total_s) for r in results)
        )
    return results


if __name__ == "__main__":
    main()
