"""`splitserve bench serve` against a live `splitserve up` (a subprocess on local Ray, the tiny
model): every dataset completes and asks for exactly what it gets."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from bench.result import BenchmarkResult
from cli.main import main
from splitserve.tiny_model import make_tiny_model

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 120.0
API_KEY = "bench-test-key"

pytestmark = pytest.mark.timeout(600)


def _write_config(path: Path, model_path: Path) -> Path:
    pools = {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB", "max_num_seqs": 16}
    config = {
        "model": {"path": str(model_path), "name": "tiny"},
        "mode": "disaggregated",
        "gateway": {"host": "127.0.0.1", "port": 0, "api_keys": [API_KEY]},
        "prefill": pools,
        "decode": pools,
        "store": {"memory_bytes": "128MiB", "disk": {"path": None}},
        "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300},
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bench-live-model"), seed=3)


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[str]:
    """`splitserve up` in a subprocess; its gateway URL once it prints it; SIGTERM and wait after."""
    config = _write_config(tmp_path_factory.mktemp("bench-live") / "up.yaml", model_path)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "up", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    seen: list[str] = []

    def drain() -> None:  # keeps reading to the end, so the pipe never fills
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        yield _wait_for_gateway(lines, seen)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            status = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        reader.join(timeout=10)
        assert status == 0, "".join(seen[-40:])


def _wait_for_gateway(lines: queue.Queue[str | None], seen: list[str]) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise TimeoutError(
                f"splitserve up printed no gateway line in {START_TIMEOUT_S:g} s:\n{''.join(seen[-40:])}"
            )
        try:
            line = lines.get(timeout=remaining_s)
        except queue.Empty:
            continue
        if line is None:
            raise RuntimeError(f"splitserve up exited before serving:\n{''.join(seen[-40:])}")
        seen.append(line)
        if line.startswith("gateway: http"):
            return line.split(maxsplit=1)[1].strip()


@pytest.mark.parametrize(
    ("dataset", "options"),
    [
        ("random", ["--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "5", "--random-range-ratio", "0.5"]),
        ("shared-prefix", ["--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "40",
                           "--gsp-question-len", "6", "--gsp-output-len", "4"]),
        ("multi-turn", ["--mt-num-sessions", "2", "--mt-turns", "3", "--mt-user-len", "8", "--mt-output-len", "4"]),
    ],
)  # fmt: skip
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_dataset_completes_against_a_live_cluster(
    gateway_url, model_path, tmp_path, dataset, options, endpoint
):
    result_file = tmp_path / "result.json"
    status = main(
        ["bench", "serve", "--base-url", gateway_url, "--model", str(model_path), "--served-model-name", "tiny",
         "--api-key", API_KEY, "--endpoint", endpoint, "--dataset", dataset, "--max-concurrency", "4",
         "--disable-tqdm", "--result-file", str(result_file), *options]
    )  # fmt: skip
    result = BenchmarkResult.load(result_file)
    assert status == 0, [r.error for r in result.records if not r.success]
    assert result.summary.failed == 0 and result.summary.completed == len(result.records) == 6
    for r in result.records:
        assert r.output_tokens == r.max_tokens  # ignore_eos: exactly what was asked
        assert r.prompt_tokens > 0 and r.ttft_s is not None and r.e2e_s >= r.ttft_s
    assert result.summary.total_output_tokens == sum(r.max_tokens for r in result.records)


def test_a_token_id_workload_runs_without_a_tokenizer(gateway_url, tmp_path):
    result_file = tmp_path / "result.json"
    status = main(
        ["bench", "serve", "--base-url", gateway_url, "--model", "tiny", "--api-key", API_KEY, "--num-prompts", "4",
         "--random-input-len", "16", "--random-output-len", "3", "--disable-tqdm", "--result-file", str(result_file)]
    )  # fmt: skip
    result = BenchmarkResult.load(result_file)
    assert status == 0 and result.summary.completed == 4
    assert all(r.prompt_tokens == 16 and r.output_tokens == 3 for r in result.records)


def test_without_the_api_key_every_request_fails_with_the_gateways_401(gateway_url, tmp_path):
    result_file = tmp_path / "result.json"
    status = main(
        ["bench", "serve", "--base-url", gateway_url, "--model", "tiny", "--api-key", "wrong", "--num-prompts", "2",
         "--random-input-len", "4", "--random-output-len", "2", "--disable-tqdm", "--result-file", str(result_file)]
    )  # fmt: skip
    result = BenchmarkResult.load(result_file)
    assert status == 1 and result.summary.failed == 2
    assert all(r.error.startswith("HTTP 401: ") for r in result.records)
