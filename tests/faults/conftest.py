"""A real deployment (local Ray: controller, gateway, workers and store as processes) with the
store's fault hook armed, and what the fault tests read from it: the gateway's metrics, raw
HTTP requests a test can cut at any moment, and the fault hook's log."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from deploy.launcher import ClusterHandle, run_cluster
from splitserve.config import parse_config
from splitserve.tiny_model import make_tiny_model
from state_store.faults import ENV_VAR

MODEL = "tiny"
TOKEN_IDS = {"ignore_eos": True, "return_tokens_as_token_ids": True, "logprobs": 0}


@pytest.fixture(scope="session")
def fault_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fault-model"), seed=7)


class FaultFile:
    """The JSON file the store's fault hook reads (state_store/faults.py) and its log."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.log_path = Path(f"{path}.log")

    def arm(self, **spec: Any) -> None:
        """Arms the faults in `spec` and clears the log."""
        self.log_path.unlink(missing_ok=True)
        self._write(spec)

    def disarm(self) -> None:
        """No more faults; the log stays."""
        self._write({})

    def _write(self, spec: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, self.path)  # the store never reads a half-written file

    def hits(self) -> list[list[str]]:
        """One entry per fault injected: ["fail", key] or ["flip", kind, key]."""
        if not self.log_path.exists():
            return []
        return [line.split(" ") for line in self.log_path.read_text().splitlines()]


@contextmanager
def fault_cluster(
    fault_path: Path, model: Path, *, prefill: dict[str, Any], decode: dict[str, Any], **sections: Any
) -> Iterator[ClusterHandle]:
    """Local Ray and a deployment whose every process inherits the fault hook's variable."""
    os.environ[ENV_VAR] = str(fault_path)  # before Ray starts: its workers inherit the environment
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    data = {
        "model": {"path": str(model), "name": MODEL},
        "gateway": {"port": 0},
        "prefill": {"num_cpus": 0.5, **prefill},
        "decode": {"num_cpus": 0.5, **decode},
        "store": {"memory_bytes": "256MiB", "disk": {"path": None}},
        "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300},
        # no retained prefixes: a store's baseline is then empty, and every request moves its state
        "cache": {"enable_prefix_caching": False},
        **sections,
    }
    try:
        with run_cluster(parse_config(data)) as handle:
            yield handle
    finally:
        ray.shutdown()
        os.environ.pop(ENV_VAR, None)


def metric_value(gateway_url: str, name: str, **labels: str) -> float:
    """The sum of the gateway's samples called `name` whose labels include `labels`."""
    text = httpx.get(f"{gateway_url}/metrics", timeout=30).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


class RawRequest:
    """One POST on a socket of its own, so a test can cut the connection in any phase."""

    def __init__(self, gateway_url: str, path: str, body: dict[str, Any]) -> None:
        host, port = httpx.URL(gateway_url).host, httpx.URL(gateway_url).port
        assert port is not None
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection((host, port), timeout=120)  # a hang guard, not a wait
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        )
        self.sock.sendall(head.encode() + payload)
        self.received = b""

    def read_until(self, marker: bytes, count: int = 1) -> None:
        """Reads until `marker` was seen `count` times (e.g. SSE events), or the server closed."""
        while self.received.count(marker) < count:
            data = self.sock.recv(65536)
            if not data:
                raise AssertionError(f"the server closed early: {self.received[-500:]!r}")
            self.received += data

    def cut(self) -> None:
        """The client goes away."""
        self.sock.close()


@contextmanager
def slow_prefill_cluster(model: Path) -> Iterator[tuple[ClusterHandle, FaultFile]]:
    """A deployment whose prefill worker takes 8 tokens a step and one sequence at a time: a long
    prompt prefills for hundreds of steps and a second one waits behind it, accepted but not
    started, so a test can act in each phase. Its fault file comes with it, disarmed."""
    prefill = {"kv_cache_memory_bytes": "64MiB", "max_num_batched_tokens": 8, "max_num_seqs": 1}
    decode = {"kv_cache_memory_bytes": "64MiB"}
    with tempfile.TemporaryDirectory(prefix="splitserve-faults-") as tmp:
        path = Path(tmp) / "faults.json"
        with fault_cluster(path, model, prefill=prefill, decode=decode) as handle:
            yield handle, FaultFile(path)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 180.0) -> None:
    """Polls an observable condition; `timeout_s` guards against a hang, it is no latency bound."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)
