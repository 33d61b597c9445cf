"""Experiment: decode failover's recovery time, death to next token, by context length and method.

    python -m experiments.failover [--contexts 512,2048,8192] [--probes 3] [--tokens-before 24]
        [--methods reprefill,stored]

For each method, starts a real deployment on local Ray (1 prefill, 2 decode workers, the tiny
model with a 16k context, prefix caching off so every re-prefill computes its whole context):
`reprefill` with `decode.replay_window: 0` (the stream is re-prefilled from prompt + the tokens
sent), `stored` with `decode.replay_window: --window` (the decode workers keep each request's
state in the node's store as they decode, and the stream resumes from it). Per context length N
and probe: streams one greedy request of an N-token prompt through the gateway, and once
`--tokens-before` tokens have arrived SIGKILLs the decode worker running it (its pid from the
controller's status). Recovery is the time from the kill to the next token the client receives.
Each probe's whole output is checked against the same request run again uninterrupted (greedy:
the tokens must be equal), the method the gateway used is read from
`splitserve_decode_failovers_total`, and the pool is restored (the controller restarts the
killed worker) before the next probe.

Printed per method and context: the fresh request's TTFT (a prefill of N tokens, the floor of a
re-prefill of N + sent tokens), the decode ITL before the kill, recovery (median, min, max; and
in ITLs), the probes that failed over by the method measured, and for `stored` the bytes the
decode worker published per generated token (its publisher's counters just before the kill).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import httpx
import ray

from deploy.launcher import ClusterHandle, run_cluster
from splitserve.config import ClusterConfig, parse_config
from splitserve.tiny_model import make_tiny_model

MODEL = "tiny"
MAX_CONTEXT = 16384


@dataclass(frozen=True)
class Probe:
    ttft_s: float  # request sent -> first token
    itl_s: float  # median gap between tokens before the kill
    recovery_s: float  # SIGKILL -> the next token at the client
    exact: bool  # the whole output equals the same request run uninterrupted
    method: str  # how the gateway resumed it (splitserve_decode_failovers_total's method)
    bytes_per_token: float  # published by the killed worker so far, per token its pieces cover (0: none)


def cluster_config(model_path: str, replay_window: int = 0) -> ClusterConfig:
    pool = {"num_cpus": 1, "kv_cache_memory_bytes": "96MiB", "max_num_seqs": 4}
    return parse_config(
        {
            "model": {"path": model_path, "name": MODEL, "max_model_len": MAX_CONTEXT},
            "gateway": {"port": 0},
            "prefill": pool,
            "decode": {**pool, "replicas": 2, "replay_window": replay_window},
            "store": {"memory_bytes": "512MiB", "disk": {"path": None}},
            "cache": {"enable_prefix_caching": False},
            "router": {"policy": "least_load"},
            "health": {"interval_s": 0.5, "timeout_s": 30, "start_timeout_s": 300, "max_restarts": 1000},
        }
    )


def _body(prompt: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "stream": stream,
    }


def _tokens(choice: dict[str, Any]) -> list[int]:
    logprobs = choice.get("logprobs") or {}
    return [int(t.removeprefix("token_id:")) for t in logprobs.get("tokens") or []]


def _decode_rows(handle: ClusterHandle) -> list[dict[str, Any]]:
    return handle.status()["pools"]["decode"]["workers"]  # type: ignore[no-any-return]


def _running_decode_row(handle: ClusterHandle) -> tuple[dict[str, Any], Any]:
    """The decode worker running the (one) probe request: its status row and actor handle."""
    for row in _decode_rows(handle):
        worker = ray.get(handle.controller.worker_handle.remote("decode", row["index"]), timeout=30)
        if worker is not None and ray.get(worker.stats.remote(), timeout=30)["num_running"] > 0:
            return row, worker
    raise RuntimeError("no decode worker is running the probe request")


def _published_per_token(worker: Any) -> float:
    """Bytes the worker's replay publisher wrote per token its pieces cover (0 without one)."""
    replay = ray.get(worker.stats.remote(), timeout=30).get("replay") or {}
    return replay["num_bytes"] / replay["num_tokens"] if replay.get("num_tokens") else 0.0


def _resumed_by_method(url: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("splitserve_decode_failovers_total{") and 'outcome="resumed"' in line:
            method = line.split('method="', 1)[1].split('"', 1)[0]
            counts[method] = counts.get(method, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _wait_restored(handle: ClusterHandle, killed: dict[str, Any], timeout_s: float = 300) -> None:
    deadline_s = time.monotonic() + timeout_s
    while True:
        rows = _decode_rows(handle)
        again = next(r for r in rows if r["index"] == killed["index"])
        if again["healthy"] and again["pid"] not in (None, killed["pid"]) and all(r["healthy"] for r in rows):
            return
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"the decode pool was not restored in {timeout_s:g} s: {rows}")
        time.sleep(0.2)


def probe(handle: ClusterHandle, prompt: list[int], max_tokens: int, tokens_before: int) -> Probe:
    url = handle.gateway_url
    assert url is not None, "the deployment has no gateway"
    resumed_before = _resumed_by_method(url)
    tokens: list[int] = []
    times: list[float] = []
    running: dict[str, Any] | None = None  # the decode worker running it, looked up in advance
    worker: Any = None
    bytes_per_token = 0.0
    kill_s: float | None = None
    sent_s = time.monotonic()
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=_body(prompt, max_tokens, True), timeout=600
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            new = _tokens(event["choices"][0])
            if not new:
                continue
            tokens += new
            times += [time.monotonic()] * len(new)
            if running is None and len(tokens) >= 2:  # decoding: its worker has it
                running, worker = _running_decode_row(handle)
            if running is not None and kill_s is None and len(tokens) >= tokens_before:
                bytes_per_token = _published_per_token(worker)
                os.kill(running["pid"], signal.SIGKILL)
                kill_s = time.monotonic()
    after = [t for t in times if kill_s is not None and t > kill_s]
    if running is None or kill_s is None or not after:
        raise RuntimeError(f"the kill never landed mid-stream ({len(tokens)} tokens): raise --max-tokens")
    # Tokens the dead worker had sent may still be read after the kill; the failover is the
    # longest wait after it, and recovery ends at the token that ends that wait.
    waits = [b - a for a, b in zip([kill_s, *after], after)]
    recovery_s = after[waits.index(max(waits))] - kill_s
    gaps = [b - a for a, b in zip(times[1:], times[2:]) if not a < kill_s + recovery_s <= b]
    again = httpx.post(f"{url}/v1/completions", json=_body(prompt, max_tokens, False), timeout=600)
    again.raise_for_status()
    exact = _tokens(again.json()["choices"][0]) == tokens
    resumed = _resumed_by_method(url)
    methods = [m for m, n in resumed.items() if n > resumed_before.get(m, 0.0)]
    _wait_restored(handle, running)
    itl_s = statistics.median(gaps) if gaps else 0.0
    return Probe(times[0] - sent_s, itl_s, recovery_s, exact, "+".join(methods) or "none", bytes_per_token)


def report(method: str, context: int, probes: list[Probe]) -> str:
    def ms(value: float) -> str:
        return f"{value * 1e3:,.1f}"

    recovery = [p.recovery_s for p in probes]
    itl = statistics.median(p.itl_s for p in probes)
    median = statistics.median(recovery)
    by_method = sum(p.method == METHODS[method][1] for p in probes)
    published = statistics.median(p.bytes_per_token for p in probes)
    return (
        f"| {method} | {context:,} | {ms(statistics.median(p.ttft_s for p in probes))} | {ms(itl)} | "
        f"{ms(median)} ({ms(min(recovery))}-{ms(max(recovery))}) | {median / itl if itl else 0:.0f} | "
        f"{sum(p.exact for p in probes)}/{len(probes)} | {by_method}/{len(probes)} | "
        f"{f'{published:,.0f}' if published else '-'} |"
    )


# method -> (decode.replay_window, the metric's method label it must show)
METHODS = {"reprefill": (0, "reprefill"), "stored": (16, "stored_state")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="512,2048,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--probes", type=int, default=3, help="kills per context")
    parser.add_argument("--tokens-before", type=int, default=24, help="tokens received before the kill")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per probe request")
    parser.add_argument("--methods", default="reprefill,stored", help=f"of {sorted(METHODS)}")
    args = parser.parse_args()
    methods = args.methods.split(",")
    if set(methods) - set(METHODS):
        parser.error(f"--methods takes {sorted(METHODS)}")
    contexts = [int(c) for c in args.contexts.split(",")]
    if max(contexts) + args.max_tokens > MAX_CONTEXT:
        parser.error(f"contexts + max_tokens must fit the model's {MAX_CONTEXT:,} tokens")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(tmp, seed=0, max_position_embeddings=MAX_CONTEXT)
        print(
            "| method | context (tokens) | TTFT, fresh (ms) | ITL (ms) | recovery, median (min-max) (ms) "
            "| recovery / ITL | exact | by this method | published bytes / token |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for method in methods:
            rng = random.Random(0)  # the same prompts for every method
            with run_cluster(cluster_config(str(model), METHODS[method][0])) as handle:
                for context in contexts:
                    probes = []
                    for _ in range(args.probes):
                        prompt = [rng.randrange(3, 2000) for _ in range(context)]
                        probes.append(probe(handle, prompt, args.max_tokens, args.tokens_before))
                    print(report(method, context, probes), flush=True)


if __name__ == "__main__":
    main()
