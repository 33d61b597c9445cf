"""Benchmark: n samples from one prefill against n separate requests; a prompt sent twice.

    python -m experiments.parallel_sampling [--prompt 1260] [--n 4] [--output 32] [--repeats 5]

On the offline engine (`LLMEngine`, the embedded tiny model, unit 64, prefix caching on):

* samples: one request of `n` seeded samples against `n` separate requests seeded seed + i, all
  added at once: the tokens the steps computed, the most KV blocks held at once, the wall time
  (the tokens are the same: tests/engine/test_parallel_sampling.py).
* repeat: a fresh `prompt`-token prompt, then the same prompt again (`max_tokens` 1: the TTFT),
  with the snapshot at the last unit before the prompt's last token kept (now) and not (before):
  the cached tokens of the second, and both requests' times (the first pays one more step).

Times are the minimum over `repeats` (fresh prompts each time). Figures only: nothing here
asserts on time.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any


def _engine(path: Path, **kwargs: Any) -> Any:
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine_config import EngineConfig

    config = dict(model=str(path), max_model_len=4096, enable_prefix_caching=True, prefix_unit=64)
    return LLMEngine(EngineConfig(**{**config, **kwargs}))  # type: ignore[arg-type]


def _drain(engine: Any) -> tuple[int, int]:
    """Run to the end; (tokens the steps computed, most KV blocks held at once)."""
    computed, peak = [0], 0
    blocks, execute = engine.scheduler.blocks, engine.runner.execute

    def counting(scheduled, *rest):  # type: ignore[no-untyped-def]
        computed[0] += sum(s.num_new_tokens for s in scheduled)
        return execute(scheduled, *rest)

    engine.runner.execute = counting
    try:
        while engine.has_unfinished_requests:
            engine.step()
            peak = max(peak, blocks.num_blocks - blocks.num_free_blocks)
    finally:
        engine.runner.execute = execute
    return computed[0], peak


def samples(path: Path, args: argparse.Namespace) -> None:
    from splitserve import SamplingParams

    rng = random.Random(1)
    best: dict[str, tuple[float, int, int]] = {}
    for rep in range(args.repeats):
        prompt = [rng.randrange(3, 900) for _ in range(args.prompt)]
        params = SamplingParams(n=args.n, temperature=0.9, seed=rep, max_tokens=args.output, ignore_eos=True)
        for mode in ("one request of n", "n separate requests"):
            engine = _engine(path)
            started = time.perf_counter()
            if mode == "one request of n":
                engine.add_request("r", prompt, params)
            else:
                for i in range(args.n):
                    engine.add_request(f"r{i}", prompt, params.replace(n=1, seed=rep + i))
            computed, peak = _drain(engine)
            wall_s = time.perf_counter() - started
            if mode not in best or wall_s < best[mode][0]:
                best[mode] = (wall_s, computed, peak)
    print(
        f"\nsamples: {args.n} x {args.output} tokens of one {args.prompt}-token prompt (min of {args.repeats})"
    )
    print("| mode | wall (ms) | tokens computed | KV blocks held at most |")
    print("|---|---|---|---|")
    for mode, (wall_s, computed, peak) in best.items():
        print(f"| {mode} | {wall_s * 1e3:,.0f} | {computed:,} | {peak:,} |")


def repeat(path: Path, args: argparse.Namespace) -> None:
    from splitserve import SamplingParams
    from splitserve.engine.prefix_cache.retention import RetentionPolicy

    kept = RetentionPolicy.pre_end
    rows = {}
    for mode in ("kept (now)", "not kept (before)"):
        RetentionPolicy.pre_end = kept if mode == "kept (now)" else (lambda self, num_hit, input_end: None)  # type: ignore[method-assign]
        try:
            engine = _engine(path)
            rng = random.Random(2)
            firsts: list[float] = []
            seconds: list[float] = []
            cached = 0
            for rep in range(args.repeats):
                prompt = [rng.randrange(3, 900) for _ in range(args.prompt)]
                for times in (firsts, seconds):
                    started = time.perf_counter()
                    request = engine.add_request(
                        f"{mode}-{rep}-{len(times)}", prompt, SamplingParams(max_tokens=1)
                    )
                    _drain(engine)
                    times.append(time.perf_counter() - started)
                cached = request.num_cached_tokens
            rows[mode] = (min(firsts), min(seconds), cached)
        finally:
            RetentionPolicy.pre_end = kept  # type: ignore[method-assign]
    print(f"\nrepeat: a {args.prompt}-token prompt, then the same again (min of {args.repeats})")
    print("| pre-end snapshot | first (ms) | second (ms) | second's cached tokens |")
    print("|---|---|---|---|")
    for mode, (first_s, second_s, num_cached) in rows.items():
        print(f"| {mode} | {first_s * 1e3:,.0f} | {second_s * 1e3:,.0f} | {num_cached:,} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=1260)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from splitserve.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp), seed=0)
        samples(path, args)
        repeat(path, args)


if __name__ == "__main__":
    main()
