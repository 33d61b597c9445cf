"""Experiment: long prompts (8k, 16k, 32k tokens) end to end through a real deployment.

    python -m experiments.long_prompt [--sizes 8192,16384,32768] [--max-tokens 4] [--skip-offline]

Builds the `tiny-long` tiny model (`tiny`'s weights with a 64k context), starts a deployment on
its own local Ray under the name `h17long` (1 prefill, 1 decode worker, the default config
otherwise: KV budget, chunk size, gateway limits and timeouts as shipped; `max_model_len` the
longest size plus 1,024), and sends one greedy request per size (token-id prompts, EOS ignored,
streamed). Per size it prints: TTFT at the client, the state bytes the prefill handed to the
decode (the gateway's `splitserve_state_transfer_bytes`), the peak RSS (VmHWM) of every process
of the deployment so far (prefill, decode, store, gateway), and, from the offline engine
(`splitserve.LLM`, prefix caching off, one thread like a `num_cpus: 1` worker) driven a step at
a time on the same prompt: the prefill's chunks (steps before the first token), its longest step
(how long a call queued behind the engine, such as the health probe's `stats()`, waits) and
whether the cluster's tokens equal its tokens. The offline runs come after the deployment ends,
so they do not share the CPUs with it. `--health-timeout-s` overrides `health.timeout_s` (the
controller restarts a worker whose `stats()` does not answer within it, or whose engine step has
run past 30 times it).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from deploy.launcher import ClusterHandle, run_cluster
from experiments.failover import MODEL as SERVED_NAME
from experiments.failover import _body as request_body
from experiments.failover import _tokens as choice_tokens
from splitserve import LLM, SamplingParams
from splitserve.config import ClusterConfig, HealthConfig, PrefillPoolConfig, parse_config
from splitserve.tiny_model import make_tiny_model

PRESET = "tiny-long"
NAME = "h17long"  # its own deployment name: its own Ray, never the default cluster's
HEADROOM_TOKENS = 1024  # max_model_len past the longest prompt


@dataclass(frozen=True)
class Result:
    num_prompt_tokens: int
    ttft_s: float
    total_s: float
    token_ids: list[int]
    state_bytes: float  # handed from prefill to decode for this request
    peak_rss_bytes: dict[str, int]  # process label -> VmHWM so far


def cluster_config(model_path: str, max_model_len: int, health_timeout_s: float) -> ClusterConfig:
    return parse_config(
        {
            "model": {"path": model_path, "name": SERVED_NAME, "max_model_len": max_model_len},
            "gateway": {"port": 0},
            "store": {"disk": {"path": None}},
            "health": {"start_timeout_s": 600, "timeout_s": health_timeout_s},
        }
    )


def stream_tokens(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """One streamed completion: (token ids, seconds to the first token, seconds to the last)."""
    tokens: list[int] = []
    first_s = 0.0
    sent_s = time.monotonic()
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=request_body(prompt, max_tokens, True), timeout=1800
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{len(prompt):,}-token prompt: HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{len(prompt):,}-token prompt: the stream failed: {event['error']}")
            new = choice_tokens(event["choices"][0])
            if new and not tokens:
                first_s = time.monotonic() - sent_s
            tokens += new
    return tokens, first_s, time.monotonic() - sent_s


def metric_sum(url: str, name: str) -> float:
    """The sum of every series of one metric on the gateway's /metrics (0 if absent)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def deployment_pids(handle: ClusterHandle) -> dict[str, int]:
    """Process label -> pid of every member of the deployment (workers, stores, gateway)."""
    status = handle.status()
    pids: dict[str, int] = {}
    for pool, section in status["pools"].items():
        for row in section["workers"]:
            pids[f"{pool} {row['index']}"] = row["pid"]
    for row in status["stores"]:
        pids[f"store {row['index']}"] = row["pid"]
    if status.get("gateway"):
        pids["gateway"] = status["gateway"]["pid"]
    return {label: pid for label, pid in pids.items() if pid}


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM) since it started; 0 if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_deployment(
    model_path: str, prompts: list[list[int]], max_tokens: int, health_timeout_s: float
) -> list[Result]:
    max_model_len = max(map(len, prompts)) + HEADROOM_TOKENS
    results = []
    config = cluster_config(model_path, max_model_len, health_timeout_s)
    with run_cluster(config, name=NAME) as handle:
        url = handle.gateway_url
        assert url is not None, "the deployment has no gateway"
        pids = deployment_pids(handle)
        for prompt in prompts:
            moved_before = metric_sum(url, "splitserve_state_transfer_bytes_sum")
            tokens, ttft_s, total_s = stream_tokens(url, prompt, max_tokens)
            moved = metric_sum(url, "splitserve_state_transfer_bytes_sum") - moved_before
            rss = {label: peak_rss_bytes(pid) for label, pid in pids.items()}
            results.append(Result(len(prompt), ttft_s, total_s, tokens, moved, rss))
            print(f"# {len(prompt):,} tokens: TTFT {ttft_s:.1f} s, tokens {tokens}", flush=True)
    return results


@dataclass(frozen=True)
class Offline:
    """One prompt through the offline engine, driven a step at a time like a worker's loop."""

    token_ids: list[int]
    num_prefill_steps: int  # steps before the first token: the prefill's chunks
    longest_step_s: float  # what a control call queued behind the engine (stats()) may wait


def offline_runs(model_path: str, prompts: list[list[int]], max_tokens: int) -> list[Offline]:
    """Each prompt's greedy tokens from the offline engine (one at a time, caching off, one thread
    like a `num_cpus: 1` worker), with its prefill steps and its longest step timed."""
    llm = LLM(model=model_path, max_model_len=max(map(len, prompts)) + HEADROOM_TOKENS, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runs = []
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"offline-{i}", prompt, params)
        tokens: list[int] = []
        num_prefill_steps, longest_s, finished = 0, 0.0, False
        while not finished:
            start_s = time.perf_counter()
            updates = llm.engine.step()
            longest_s = max(longest_s, time.perf_counter() - start_s)
            num_prefill_steps += not tokens
            for update in updates:
                tokens += update.new_token_ids
                finished = finished or update.finished
        runs.append(Offline(tokens, num_prefill_steps, longest_s))
    return runs


def report(results: list[Result], offline: list[Offline] | None, chunk_tokens: int) -> str:
    labels = sorted({label for r in results for label in r.peak_rss_bytes})
    head = "| prompt (tokens) | TTFT (s) | total (s) | state moved (MiB) | prefill chunks | "
    head += " | ".join(f"peak RSS {label} (MiB)" for label in labels)
    head += " | longest step, offline (s) | tokens = offline |"
    rows = [head, "|" + "---:|" * (7 + len(labels))]
    for i, r in enumerate(results):
        rss = " | ".join(f"{r.peak_rss_bytes.get(label, 0) / 2**20:,.0f}" for label in labels)
        chunks, longest, exact = f"{-(-r.num_prompt_tokens // chunk_tokens)} (planned)", "-", "-"
        if offline is not None:
            o = offline[i]
            chunks, longest = str(o.num_prefill_steps), f"{o.longest_step_s:.1f}"
            exact = "yes" if r.token_ids == o.token_ids else f"NO {o.token_ids}"
        rows.append(
            f"| {r.num_prompt_tokens:,} | {r.ttft_s:.1f} | {r.total_s:.1f} | {r.state_bytes / 2**20:.2f} | "
            f"{chunks} | {rss} | {longest} | {exact} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8192,16384,32768", help="prompt lengths, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per request")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' and the weights' seed")
    parser.add_argument(
        "--health-timeout-s",
        type=float,
        default=HealthConfig().timeout_s,
        help="health.timeout_s (default: the config's): a worker whose stats() does not answer within it, "
        "or whose engine step has run past 30 times it, is restarted",
    )
    parser.add_argument("--skip-offline", action="store_true", help="do not check against splitserve.LLM")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 2000) for _ in range(int(n))] for n in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, preset=PRESET, seed=args.seed))
        results = run_deployment(model, prompts, args.max_tokens, args.health_timeout_s)
        offline = None if args.skip_offline else offline_runs(model, prompts, args.max_tokens)
    print(report(results, offline, PrefillPoolConfig().max_num_batched_tokens))


if __name__ == "__main__":
    main()
