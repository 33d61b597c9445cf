"""The device check's `cluster` stage: the whole deployment on one GPU, driven as a user would.

    python -m experiments.gpu_cluster [--config deploy/configs/gpu-one.yaml] [--json PATH]

Starts `splitserve up --config CONFIG` (its own local Ray; one prefill and one decode worker
sharing the GPU), waits for `/health`, sends greedy prompts as token ids and compares each reply
with the offline engine on the same device (`splitserve.LLM`: per row, how many leading tokens
agree; bf16 near ties may flip a token, fp32 should agree whole), then drives `splitserve bench
serve` (random 512 in / 128 out) at concurrency 16 and 64 and prints TTFT, TPOT and throughput;
then stops the deployment (SIGTERM to its process group, SIGKILL past a grace period).

`--smoke` (the CPU smoke mode of scripts/gpu_check.sh): checks the config (`config check`,
`config plan`) and starts nothing. Without Ray installed (a GPU machine with no network: Ray's
wheel is 79 MB) the stage says so and exits 3 (skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from experiments.gpu_common import progress, write_figures

SKIPPED = 3  # the exit status scripts/gpu_check.sh records as "skipped"
NUM_CHECKED_PROMPTS = 8
CHECKED_TOKENS = 32


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _splitserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]


@contextlib.contextmanager
def deployment(config: Path, port: int, start_timeout_s: float) -> Iterator[str]:
    """`splitserve up` in its own process group; the gateway's URL once /health says ok."""
    import httpx

    log = open(Path(tempfile.gettempdir()) / f"splitserve-gpu-cluster-{port}.log", "w")  # noqa: SIM115
    process = subprocess.Popen(
        _splitserve("up", "--config", str(config), "--port", str(port)),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline_s = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"splitserve up exited {process.returncode}; its log: {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).json().get("status") == "ok":
                    break
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"the deployment was not healthy within {start_timeout_s:g} s ({log.name})")
            time.sleep(1.0)
        progress(f"deployment up at {url}")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        log.close()


def _prompts(vocab_size: int) -> list[list[int]]:
    import random

    rng = random.Random(7)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(64, 512))] for _ in range(NUM_CHECKED_PROMPTS)]


def compare_tokens(url: str, model_path: str, model_name: str, device: str) -> dict[str, Any]:
    """Greedy replies through the gateway against the offline engine's; leading tokens in common."""
    import httpx

    from splitserve import LLM, SamplingParams

    llm = LLM(model=model_path, device=device)
    prompts = _prompts(min(llm.engine.model_config.vocab_size, 2000))
    params = SamplingParams(temperature=0, max_tokens=CHECKED_TOKENS, ignore_eos=True)
    offline = [r.outputs[0].token_ids for r in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    common = []
    for prompt, want in zip(prompts, offline):
        body = {
            "model": model_name,
            "prompt": prompt,
            "max_tokens": CHECKED_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
        got = [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        common.append(same)
    return {"rows": len(common), "tokens_per_row": CHECKED_TOKENS, "common_prefix": common}


def bench(url: str, model_name: str, tokenizer: str, concurrency: int, scratch: Path) -> dict[str, Any]:
    """One `splitserve bench serve` run: its summary's headline figures."""
    result = scratch / f"bench-{concurrency}.json"
    subprocess.run(
        _splitserve(
            "bench", "serve", "--base-url", url, "--model", model_name, "--tokenizer", tokenizer,
            "--dataset", "random", "--random-input-len", "512", "--random-output-len", "128",
            "--num-prompts", str(4 * concurrency), "--max-concurrency", str(concurrency),
            "--extra-body", json.dumps({"ignore_eos": True}), "--result-file", str(result),
            "--disable-tqdm", "--seed", "0",
        ),  # fmt: skip
        check=True,
        timeout=600,
    )
    summary = json.loads(result.read_text())["summary"]
    return {
        "concurrency": concurrency,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "ttft_p50_ms": summary["ttft"].get("median_ms"),
        "tpot_p50_ms": summary["tpot"].get("median_ms"),
        "output_tok_s": summary["output_throughput_tps"],
        "request_rps": summary["request_throughput_rps"],
    }


def check_config(config: Path) -> dict[str, Any]:
    """`config check` and `config plan` of the stage's config, as a deployer runs them first."""
    figures: dict[str, Any] = {}
    for what in ("check", "plan"):
        done = subprocess.run(_splitserve("config", what, str(config)), capture_output=True, text=True)
        print(done.stdout[-2000:], done.stderr[-2000:], sep="")
        if done.returncode != 0:
            raise RuntimeError(f"splitserve config {what} {config} failed ({done.returncode})")
        figures[f"config_{what}"] = "ok"
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/configs/gpu-one.yaml")
    parser.add_argument("--device", default="cuda", help="where the offline engine runs to compare tokens")
    parser.add_argument("--smoke", action="store_true", help="check the config only; start nothing")
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    config = Path(args.config)
    if not config.is_file():
        print(f"SKIP: {config} is missing")
        return SKIPPED
    figures = check_config(config)
    if args.smoke:
        write_figures(args.json, "config check + plan ok (smoke: no cluster started)", figures)
        return 0
    if importlib.util.find_spec("ray") is None:
        print("SKIP: ray is not installed here (its 79 MB wheel: add it to the --wheelhouse)")
        return SKIPPED
    from splitserve.config import load_config
    from splitserve.default_model import default_model_path

    cfg = load_config(config)
    model_path = str(cfg.model.path or default_model_path())
    model_name = cfg.model.name or Path(model_path).name
    with tempfile.TemporaryDirectory() as tmp, deployment(config, _free_port(), args.start_timeout_s) as url:
        figures["tokens"] = compare_tokens(url, model_path, model_name, args.device)
        progress(f"tokens: leading tokens in common per row {figures['tokens']['common_prefix']}")
        figures["bench"] = [
            bench(url, model_name, model_path, int(c), Path(tmp)) for c in args.concurrency.split(",")
        ]
    rows = figures["bench"]
    summary = "; ".join(
        f"c={r['concurrency']}: TTFT p50 {r['ttft_p50_ms']:.0f} ms, TPOT p50 {r['tpot_p50_ms']:.1f} ms, "
        f"{r['output_tok_s']:.0f} tok/s out, {r['failed']} failed"
        for r in rows
    )
    common = figures["tokens"]["common_prefix"]
    summary += f"; greedy rows whole: {sum(c == CHECKED_TOKENS for c in common)}/{len(common)}"
    write_figures(args.json, summary, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
