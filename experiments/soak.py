"""Soak: mixed load with random worker kills for N minutes; errors by kind, leaks, latency drift.

    python -m experiments.soak --minutes 10 [--attach NAME | --replicas 2] [--concurrency 8]
                               [--kill-every-s 45] [--kill prefill,decode,store] [--json soak.json]

Starts a local deployment of the tiny model (`--replicas` prefill and decode workers, so a kill
leaves one of each serving while the controller restarts the other) or attaches to a
running one (`--attach`, the deployment's name). `--concurrency` clients send requests back to
back: streaming or not, short or long prompts, one prompt or two (the gateway refuses n > 1),
greedy or seeded, and some of them hang up midway (a stream after a few events, a whole
response after a short wait). Every `--kill-every-s` seconds one process, a prefill worker, a
decode worker or a node's state store in turn (`--kill`), is SIGKILLed through the pid its
controller reports (so the soak must run on the workers' machine); the controller restarts it.

The report: requests by outcome ("ok", "disconnected" on purpose, each error kind: HTTP status
and error code, an error event inside a stream, a transport failure); the kills; what the
deployment holds before the load (after a warm-up) and after it, once drained (RSS of the
gateway, workers and stores, each pool's blocks/slots/reservations in use, the stores' keys
and bytes, of which retained prefixes are kept on purpose); and TTFT and inter-token latency
p50 in the first minute against the last, with the machine's load average at both ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import ray

ROUTE = "/v1/completions"
WINDOW_S = 60.0  # the first and the last minute are compared for drift
DRAIN_TIMEOUT_S = 120.0
BACKOFF_S = 0.5
USAGE_KEYS = ("kv_blocks_in_use", "state_slots_in_use", "num_reserved", "num_running", "num_waiting")


@dataclass
class Outcome:
    """One request as the client saw it."""

    start_s: float  # since the load began
    kind: str
    message: str = ""  # what the gateway said, for an error
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)


def _body(rng: random.Random, model: str) -> tuple[dict[str, Any], int | None]:
    """A random request and, if the client will hang up, after how many stream events
    (0: a whole response, cut after a short wait)."""
    long = rng.random() < 0.2
    prompt = [rng.randrange(3, 2000) for _ in range(rng.randint(300, 1200) if long else rng.randint(4, 64))]
    body: dict[str, Any] = {
        "model": model,
        # several choices in one request: two prompts (the gateway refuses n > 1 with a 400)
        "prompt": [prompt, prompt[: len(prompt) // 2 + 1]] if rng.random() < 0.15 else prompt,
        "max_tokens": rng.randint(2, 32),
        "stream": rng.random() < 0.5,
        "ignore_eos": True,
    }
    if rng.random() < 0.5:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
    else:
        body["temperature"] = 0
    hang_up = None
    if rng.random() < 0.1:
        hang_up = rng.randint(1, 4) if body["stream"] else 0
    return body, hang_up


def _error(response: httpx.Response, body: bytes, out: Outcome) -> None:
    try:
        error = json.loads(body)["error"]
        code, out.message = error.get("code"), str(error.get("message"))[:300]
    except (ValueError, KeyError, TypeError, AttributeError):
        code, out.message = None, body[:300].decode(errors="replace")
    out.kind = f"http {response.status_code}" + (f" {code}" if code else "")


async def _stream(http: httpx.AsyncClient, body: dict[str, Any], hang_up: int | None, out: Outcome) -> None:
    sent = time.monotonic()
    async with http.stream("POST", ROUTE, json=body) as response:
        if response.status_code != 200:
            _error(response, await response.aread(), out)
            return
        last = None
        num_events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.kind = "ok" if out.kind == "pending" else out.kind
                return
            event = json.loads(line[6:])
            if "error" in event:
                out.kind = f"stream error {event['error'].get('code')}"
                out.message = str(event["error"].get("message"))[:300]
                continue
            now = time.monotonic()
            if last is None:
                out.ttft_s = now - sent
            else:
                out.itl_s.append(now - last)
            last, num_events = now, num_events + 1
            if hang_up is not None and num_events >= hang_up:
                out.kind = "disconnected"
                return
        out.kind = "stream ended without [DONE]"


async def _one(http: httpx.AsyncClient, body: dict[str, Any], hang_up: int | None, out: Outcome) -> None:
    try:
        if body["stream"]:
            await _stream(http, body, hang_up, out)
            return
        sent = time.monotonic()
        if hang_up == 0:
            try:
                response = await asyncio.wait_for(http.post(ROUTE, json=body), timeout=0.2)
            except TimeoutError:
                out.kind = "disconnected"
                return
        else:
            response = await http.post(ROUTE, json=body)
        if response.status_code != 200:
            _error(response, response.content, out)
            return
        out.kind = "ok"
        out.ttft_s = time.monotonic() - sent  # a whole response: its first token is its last
    except httpx.HTTPError as exc:
        out.kind = f"transport {type(exc).__name__}"


async def drive(url: str, model: str, seconds: float, concurrency: int, seed: int) -> list[Outcome]:
    """`concurrency` clients sending requests back to back for `seconds`."""
    outcomes: list[Outcome] = []
    began = time.monotonic()

    async def client(rng: random.Random) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            while time.monotonic() - began < seconds:
                body, hang_up = _body(rng, model)
                out = Outcome(time.monotonic() - began, "pending")
                outcomes.append(out)
                await _one(http, body, hang_up, out)
                if out.kind.startswith(("http 503", "http 429")):
                    await asyncio.sleep(BACKOFF_S)  # as a polite client does: no busy loop of refusals

    await asyncio.gather(*(client(random.Random(seed * 1000 + i)) for i in range(concurrency)))
    return outcomes


class Killer:
    """SIGKILLs one process every `every_s` seconds, a worker of each of `targets` in turn
    ("prefill", "decode", or "store": the node's state store) by the pid its controller reports;
    records each kill. Runs on its own thread until `stop`."""

    def __init__(
        self, controller: Any, every_s: float, seed: int, targets: tuple[str, ...] = ("prefill", "decode")
    ) -> None:
        self.controller, self.every_s, self.targets = controller, every_s, targets
        self.kills: list[dict[str, Any]] = []
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._began = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-killer", daemon=True)

    def start(self) -> Killer:
        if self.every_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s * self._rng.uniform(0.7, 1.3)):
            pool = self.targets[len(self.kills) % len(self.targets)]
            status = ray.get(self.controller.status.remote(), timeout=60)
            rows = status["stores"] if pool == "store" else status["pools"].get(pool, {}).get("workers", [])
            rows = [r for r in rows if r["healthy"] and r["pid"]]
            if not rows:
                continue
            row = self._rng.choice(rows)
            try:
                os.kill(row["pid"], signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append(
                {"at_s": round(time.monotonic() - self._began, 1), "pool": pool, "pid": row["pid"]}
            )


def _rss_bytes(pid: int | None) -> int:
    if not pid:
        return 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def snapshot(controller: Any) -> dict[str, Any]:
    """What the deployment holds now: RSS per part, each pool's usage, the stores' keys and bytes."""
    status = ray.get(controller.status.remote(), timeout=60)
    gateway = status["gateway"] or {}
    pools: dict[str, dict[str, int]] = {}
    for name, pool in status["pools"].items():
        usage = dict.fromkeys(("rss_bytes", "num_workers", *USAGE_KEYS), 0)
        usage["num_rows"] = len(pool["workers"])  # workers the controller has; num_workers: that answered
        for row in pool["workers"]:
            usage["rss_bytes"] += _rss_bytes(row["pid"])
            try:  # a worker killed or restarting meanwhile is counted as not there
                handle = ray.get(controller.worker_handle.remote(name, row["index"]), timeout=60)
                stats = ray.get(handle.stats.remote(), timeout=60) if handle is not None else None
            except Exception:  # noqa: BLE001 - any Ray error means the same: no report from it now
                stats = None
            if stats is None:
                continue
            usage["num_workers"] += 1
            usage["kv_blocks_in_use"] += stats["num_total_kv_blocks"] - stats["num_free_kv_blocks"]
            usage["state_slots_in_use"] += stats["num_total_state_slots"] - stats["num_free_state_slots"]
            for key in ("num_reserved", "num_running", "num_waiting"):
                usage[key] += stats[key]
        pools[name] = usage
    # as each store last told its controller (every health interval): the test process holds no
    # cluster token, so it may not call a store itself; retained prefixes are kept on purpose
    stores = dict.fromkeys(("rss_bytes", "num_keys", "num_bytes", "num_prefix_keys", "num_prefix_bytes"), 0)
    for row in status["stores"]:
        stats = row.get("stats") or {}
        stores["rss_bytes"] += _rss_bytes(row["pid"])
        stores["num_keys"] += stats.get("num_keys", 0)
        stores["num_bytes"] += sum(tier.get("num_bytes", 0) for tier in stats.get("tiers", []))
        stores["num_prefix_keys"] += stats.get("num_prefix_keys", 0)
        stores["num_prefix_bytes"] += stats.get("num_prefix_bytes", 0)
    return {
        "healthy": status["healthy"],
        "gateway_rss_bytes": _rss_bytes(gateway.get("pid")),
        "pools": pools,
        "stores": stores,
    }


def drained(controller: Any, timeout_s: float = DRAIN_TIMEOUT_S) -> dict[str, Any]:
    """A snapshot once every pool is healthy and idle (restarts and releases trail the load), or
    the last one taken when `timeout_s` ran out: a leak never drains."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = snapshot(controller)
        idle = all(
            p["num_workers"] == p["num_rows"] and not any(p[k] for k in USAGE_KEYS)
            for p in snap["pools"].values()
        )
        stores = snap["stores"]
        if (snap["healthy"] and idle and stores["num_keys"] == stores["num_prefix_keys"]) or (
            time.monotonic() > deadline
        ):
            return snap
        time.sleep(1.0)


def _p50_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1000, 1) if values else None


def drift(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    """TTFT and ITL p50 of streamed requests in the first and the last `WINDOW_S` of the load."""
    window_s = min(WINDOW_S, seconds / 2)
    windows = {"first": lambda s: s < window_s, "last": lambda s: s >= seconds - window_s}
    report: dict[str, Any] = {"window_s": window_s}
    for name, within in windows.items():
        picked = [o for o in outcomes if within(o.start_s) and o.kind == "ok" and o.itl_s]
        report[name] = {
            "num_requests": len(picked),
            "ttft_p50_ms": _p50_ms([o.ttft_s for o in picked if o.ttft_s is not None]),
            "itl_p50_ms": _p50_ms([gap for o in picked for gap in o.itl_s]),
        }
    return report


def _leaks(start: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    growth = {"gateway_rss_bytes": end["gateway_rss_bytes"] - start["gateway_rss_bytes"]}
    for name, pool in end["pools"].items():
        before = start["pools"].get(name, {})
        for key, value in pool.items():
            growth[f"{name}.{key}"] = value - before.get(key, 0)
    for key, value in end["stores"].items():
        growth[f"stores.{key}"] = value - start["stores"][key]
    return {"start": start, "end": end, "growth": growth}


def soak(controller: Any, url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    asyncio.run(drive(url, model, min(10.0, args.minutes * 6), args.concurrency, args.seed + 1))  # warm-up
    start = drained(controller)
    load_began = os.getloadavg()[0]
    killer = Killer(controller, args.kill_every_s, args.seed, tuple(args.kill.split(","))).start()
    seconds = args.minutes * 60
    try:
        outcomes = asyncio.run(drive(url, model, seconds, args.concurrency, args.seed))
    finally:
        killer.stop()
    load_ended = os.getloadavg()[0]
    end = drained(controller)
    return {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "kill_every_s": args.kill_every_s,
        "num_requests": len(outcomes),
        "outcomes": dict(Counter(o.kind for o in outcomes).most_common()),
        "error_samples": {o.kind: o.message for o in outcomes if o.message},
        "kills": killer.kills,
        "leaks": _leaks(start, end),
        "latency_drift": drift(outcomes, seconds),
        "machine_load_1min": {"start": load_began, "end": load_ended},
    }


@contextmanager
def deployment(args: argparse.Namespace) -> Iterator[tuple[Any, str, str]]:
    """(controller, gateway URL, served model name): attached to, or started here and stopped after."""
    if args.attach:
        from deploy.control import connect_to_controller

        controller, _ = connect_to_controller(args.attach)
        status = ray.get(controller.status.remote(), timeout=60)
        yield controller, status["gateway"]["url"], status["model"]
        return
    from deploy.launcher import run_cluster
    from splitserve.config import parse_config
    from splitserve.tiny_model import make_tiny_model

    pool = {"num_cpus": 0.5, "kv_cache_memory_bytes": "64MiB", "max_num_seqs": 32, "replicas": args.replicas}
    with tempfile.TemporaryDirectory(prefix="soak-model-") as tmp:
        config = parse_config(
            {
                "model": {"path": str(make_tiny_model(Path(tmp), seed=0)), "name": "tiny"},
                "gateway": {"port": 0},
                "prefill": pool,
                "decode": pool,
                "store": {"memory_bytes": "512MiB", "disk": {"path": None}},
                "health": {
                    "interval_s": 1,
                    "timeout_s": 30,
                    "start_timeout_s": 300,
                    "max_restarts": args.max_restarts,
                },
            }
        )
        with run_cluster(config, name=f"soak-{os.getpid()}") as cluster:
            yield cluster.controller, cluster.gateway_url or "", "tiny"


def render(report: dict[str, Any]) -> str:
    mib = 1 << 20
    leaks = report["leaks"]
    lines = [
        f"soak: {report['minutes']:g} min, {report['concurrency']} clients, a worker killed every "
        f"{report['kill_every_s']:g} s ({len(report['kills'])} kills); {report['num_requests']} requests",
        "outcomes: " + ", ".join(f"{kind} {n}" for kind, n in report["outcomes"].items()),
        "held after the drain vs before the load (growth): "
        + ", ".join(
            f"{k} {v / mib:+.1f} MiB" if k.endswith("rss_bytes") else f"{k} {v:+d}"
            for k, v in leaks["growth"].items()
        ),
        f"healthy after the drain: {leaks['end']['healthy']}",
    ]
    d = report["latency_drift"]
    lines.append(
        f"latency p50, first vs last {d['window_s']:g} s (streamed, ok): TTFT {d['first']['ttft_p50_ms']} -> "
        f"{d['last']['ttft_p50_ms']} ms, ITL {d['first']['itl_p50_ms']} -> {d['last']['itl_p50_ms']} ms"
    )
    load = report["machine_load_1min"]
    lines += [f"  {kind}: {message}" for kind, message in report["error_samples"].items()]
    lines.append(
        f"machine load (1-min average): {load['start']:.2f} at the start, {load['end']:.2f} at the end"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kill-every-s", type=float, default=45.0, help="0: no kills")
    parser.add_argument(
        "--kill",
        default="prefill,decode,store",
        help="what is killed, in turn: a prefill worker, a decode worker, the node's state store",
    )
    parser.add_argument("--attach", default=None, help="the name of a running deployment to soak")
    parser.add_argument(
        "--replicas", type=int, default=2, help="workers per pool of a deployment started here"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="health.max_restarts of a deployment started here (the default, 3: a worker killed a "
        "fourth time is left down; raise it to soak recovery alone)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    with deployment(args) as (controller, url, model):
        report = soak(controller, url, model, args)
    print(render(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
