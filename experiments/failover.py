"""Experiment: decode failover's recovery time, death to next token, by context length.

    python -m experiments.failover [--contexts 512,2048,8192] [--probes 3] [--tokens-before 8]

Starts a real deployment on local Ray (1 prefill, 2 decode workers, the tiny model with a
16k context, prefix caching off so every re-prefill computes its whole context) and, per
context length N and probe: streams one greedy request of an N-token prompt through the
gateway, and once `--tokens-before` tokens have arrived SIGKILLs the decode worker running it
(its pid from the controller's status). The gateway fails the stream over by re-prefilling
prompt + the tokens already sent on the other decode worker; recovery is the time from the kill
to the next token the client receives. Each probe's whole output is checked against the same
request run again uninterrupted (greedy: the tokens must be equal), and the pool is restored
(the controller restarts the killed worker) before the next probe.

Printed per context: the fresh request's TTFT (a prefill of N tokens, the floor of a re-prefill
of N + sent tokens), the decode ITL before the kill, and recovery (median, min, max; and in
ITLs). Stored-state resume (publishing ReplaySSM records as the request decodes) is not built
yet, so re-prefill is the only method measured.
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


def cluster_config(model_path: str) -> ClusterConfig:
    pool = {"num_cpus": 1, "kv_cache_memory_bytes": "96MiB", "max_num_seqs": 4}
    return parse_config(
        {
            "model": {"path": model_path, "name": MODEL, "max_model_len": MAX_CONTEXT},
            "gateway": {"port": 0},
            "prefill": pool,
            "decode": {**pool, "replicas": 2},
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


def _running_decode_row(handle: ClusterHandle) -> dict[str, Any]:
    """The decode worker running the (one) probe request."""
    for row in _decode_rows(handle):
        worker = ray.get(handle.controller.worker_handle.remote("decode", row["index"]), timeout=30)
        if worker is not None and ray.get(worker.stats.remote(), timeout=30)["num_running"] > 0:
            return row
    raise RuntimeError("no decode worker is running the probe request")


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
    tokens: list[int] = []
    times: list[float] = []
    running: dict[str, Any] | None = None  # the decode worker running it, looked up in advance
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
                running = _running_decode_row(handle)
            if running is not None and kill_s is None and len(tokens) >= tokens_before:
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
    _wait_restored(handle, running)
    return Probe(times[0] - sent_s, statistics.median(gaps) if gaps else 0.0, recovery_s, exact)


def report(context: int, probes: list[Probe]) -> str:
    def ms(value: float) -> str:
        return f"{value * 1e3:,.1f}"

    recovery = [p.recovery_s for p in probes]
    itl = statistics.median(p.itl_s for p in probes)
    median = statistics.median(recovery)
    return (
        f"| {context:,} | {ms(statistics.median(p.ttft_s for p in probes))} | {ms(itl)} | "
        f"{ms(median)} ({ms(min(recovery))}-{ms(max(recovery))}) | {median / itl if itl else 0:.0f} | "
        f"{sum(p.exact for p in probes)}/{len(probes)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="512,2048,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--probes", type=int, default=3, help="kills per context")
    parser.add_argument("--tokens-before", type=int, default=8, help="tokens received before the kill")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per probe request")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if max(contexts) + args.max_tokens > MAX_CONTEXT:
        parser.error(f"contexts + max_tokens must fit the model's {MAX_CONTEXT:,} tokens")
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(tmp, seed=0, max_position_embeddings=MAX_CONTEXT)
        with run_cluster(cluster_config(str(model))) as handle:
            print(
                "| context (tokens) | TTFT, fresh (ms) | ITL (ms) | recovery, median (min-max) (ms) "
                "| recovery / ITL | exact |"
            )
            print("|---:|---:|---:|---:|---:|---:|")
            for context in contexts:
                probes = []
                for _ in range(args.probes):
                    prompt = [rng.randrange(3, 2000) for _ in range(context)]
                    probes.append(probe(handle, prompt, args.max_tokens, args.tokens_before))
                print(report(context, probes), flush=True)


if __name__ == "__main__":
    main()
