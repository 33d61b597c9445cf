"""Benchmark: TTFT with the engine's prefix cache on against off, side by side in one run.

    python -m experiments.prefix_cache [--preset bench-10m] [--groups 16] [--per-group 8]
        [--shared 2048] [--question 64] [--output 32] [--sessions 8] [--turns 6] [--concurrency 8]

Two workloads on the offline engine (`LLMEngine`, random-weight `make-tiny-model` checkpoint):

* shared-prefix: `groups` x `per_group` prompts, each a group's `shared`-token prefix plus its own
  `question` tokens, `output` tokens each. Prompts arrive interleaved across groups (group 0's
  first, group 1's first, ..., then every group's second, ...), at most `concurrency` in flight.
* multi-turn: `sessions` conversations of `turns` turns run at once; turn 1's prompt is
  `shared / 2 + question` tokens of its own, turn k+1's is turn k's prompt + its reply +
  `question` new tokens; `output` tokens per reply.

TTFT is the time from `add_request` to the step that returns the request's first token. Caching
off and on run the same workload (`--repeats` times each, in ABBA order, fresh prompts each time)
on one engine config each (unit 64, no interval snapshots,
selective retention on: a group's first prompt misses, its second plants the junction snapshot,
the rest hit). Figures only: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    prompt: list[int]
    tag: str  # "miss-able" label for the report: the turn number, or the prompt's index in its group
    then: Callable[[list[int]], Job | None] | None = None  # the next job once this one's reply is known


@dataclass
class Result:
    ttft_s: dict[str, list[float]] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def add(self, other: Result) -> None:
        for tag, values in other.ttft_s.items():
            self.ttft_s.setdefault(tag, []).extend(values)
            self.cached_tokens[tag] = self.cached_tokens.get(tag, 0) + other.cached_tokens[tag]
            self.prompt_tokens[tag] = self.prompt_tokens.get(tag, 0) + other.prompt_tokens[tag]
        self.wall_s += other.wall_s


def run(engine: object, jobs: list[Job], concurrency: int, output: int) -> Result:
    """Feed `jobs` (and the jobs their replies make) with at most `concurrency` in flight."""
    from splitserve import SamplingParams
    from splitserve.engine.llm_engine import LLMEngine

    assert isinstance(engine, LLMEngine)
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    queue, result, flight, ids = list(jobs), Result(), {}, iter(range(10**9))
    start = time.perf_counter()
    while queue or flight:
        while queue and len(flight) < concurrency:
            job = queue.pop(0)
            request = engine.add_request(f"j{next(ids)}", job.prompt, params)
            flight[request.request_id] = (job, time.perf_counter(), False)
        for update in engine.step():
            rid = update.request.request_id
            job, added, seen = flight[rid]
            if not seen:
                result.ttft_s.setdefault(job.tag, []).append(time.perf_counter() - added)
                result.cached_tokens[job.tag] = (
                    result.cached_tokens.get(job.tag, 0) + update.num_cached_tokens
                )
                result.prompt_tokens[job.tag] = result.prompt_tokens.get(job.tag, 0) + len(job.prompt)
                flight[rid] = (job, added, True)
            if update.finished:
                del flight[rid]
                nxt = job.then(list(update.request.output_token_ids)) if job.then else None
                if nxt is not None:
                    queue.append(nxt)
    result.wall_s = time.perf_counter() - start
    return result


def shared_prefix_jobs(args: argparse.Namespace, vocab: int, seed: int) -> list[Job]:
    rng = random.Random(1000 + seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(args.shared)] for _ in range(args.groups)]
    jobs = []
    for k in range(args.per_group):
        for prefix in prefixes:
            jobs.append(Job(prefix + [rng.randrange(3, vocab) for _ in range(args.question)], f"#{k + 1}"))
    return jobs


def multi_turn_jobs(args: argparse.Namespace, vocab: int, seed: int) -> list[Job]:
    rng = random.Random(2000 + seed)

    def turn(prompt: list[int], k: int) -> Job:
        def then(reply: list[int]) -> Job | None:
            if k == args.turns:
                return None
            return turn(prompt + reply + [rng.randrange(3, vocab) for _ in range(args.question)], k + 1)

        return Job(prompt, f"turn {k}", then)

    firsts = [
        [rng.randrange(3, vocab) for _ in range(args.shared // 2 + args.question)]
        for _ in range(args.sessions)
    ]
    return [turn(p, 1) for p in firsts]


def report(name: str, off: Result, on: Result, hit_tags: Callable[[str], bool]) -> None:
    print(f"\n== {name}")
    print(
        f"{'requests':<14}{'n':>4}{'off p50 ms':>12}{'on p50 ms':>11}{'speedup':>9}{'off mean':>10}"
        f"{'on mean':>9}{'cached':>8}"
    )
    tags = list(off.ttft_s)
    groups = {"all": tags, "hit-eligible": [t for t in tags if hit_tags(t)], **{t: [t] for t in tags}}
    for label, members in groups.items():
        a = [v for t in members for v in off.ttft_s[t]]
        b = [v for t in members for v in on.ttft_s[t]]
        if not a:
            continue
        p_off, p_on = statistics.median(a) * 1e3, statistics.median(b) * 1e3
        cached = sum(on.cached_tokens[t] for t in members) / sum(on.prompt_tokens[t] for t in members)
        print(
            f"{label:<14}{len(a):>4}{p_off:>12.1f}{p_on:>11.1f}{p_off / p_on:>8.1f}x"
            f"{statistics.mean(a) * 1e3:>10.1f}{statistics.mean(b) * 1e3:>9.1f}{cached:>8.0%}"
        )
    print(
        f"wall: off {off.wall_s:.1f} s, on {on.wall_s:.1f} s ('cached': prompt tokens the cache served, on)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="bench-10m")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--shared", type=int, default=2048)
    parser.add_argument("--question", type=int, default=64)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per mode, in ABBA order, fresh prompts each"
    )
    args = parser.parse_args(argv)

    import torch

    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine_config import EngineConfig
    from splitserve.tiny_model import make_tiny_model

    path = make_tiny_model(Path(tempfile.mkdtemp()) / args.preset, preset=args.preset, seed=0)
    print(f"model: {args.preset}; torch threads: {args.threads or torch.get_num_threads()}")
    base = EngineConfig(
        model=str(path),
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        max_model_len=args.shared
        + args.question
        + args.output * (args.turns + 1)
        + args.question * args.turns,
        kv_cache_memory_bytes=None,
        num_threads=args.threads,
        prefix_unit=64,
    )
    engines = {
        "off": LLMEngine(base),
        "on": LLMEngine(base.replace(enable_prefix_caching=True, snapshot_memory_bytes=256 * 2**20)),
    }
    vocab = engines["off"].model_config.vocab_size
    warm = [Job([5] * 300, "warm")]
    for engine in engines.values():
        run(engine, warm, 1, 4)
    for workload, make, hit_eligible in (
        ("shared-prefix", shared_prefix_jobs, lambda t: t not in ("#1", "#2")),
        ("multi-turn", multi_turn_jobs, lambda t: t != "turn 1"),
    ):
        # ABBA order (off, on, on, off, ...) so a load that drifts on a shared machine hits both
        # modes alike; each repeat draws fresh prompts, so nothing is cached from an earlier one
        results = {"off": Result(), "on": Result()}
        for r in range(args.repeats):
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                jobs = make(args, vocab, r)
                results[name].add(run(engines[name], jobs, args.concurrency, args.output))
        report(workload, results["off"], results["on"], hit_eligible)
    stats = engines["on"].prefix_cache_stats()
    print(
        f"\ncache counters (on): queried {stats.num_queried_tokens:,}, hit {stats.num_hit_tokens:,}, lost to a "
        f"missing state {stats.num_lost_to_missing_state_tokens:,}, snapshots {stats.num_snapshots} "
        f"({stats.snapshot_bytes / 2**20:.1f} MiB), evictions {stats.num_evictions}"
    )


if __name__ == "__main__":
    main()
