"""One workload against several deployments in turn: up, healthy, benchmark, down, next.

`compare_deployments(deployments, workload, launcher)` gives each deployment the same dataset
object, the same `RunConfig` (seed and arrival times included; only the URL, model name and API
key are the deployment's own) and returns one `DeploymentOutcome` each. A deployment whose config
did not load, that did not start, or whose benchmark raised is recorded with the reason and the
next one still runs. Whatever was started is stopped before the next starts, on errors and on
Ctrl-C too; a Ctrl-C during the stop is held until the stop is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from types import FrameType
from typing import TYPE_CHECKING

from bench.datasets import Dataset
from bench.deployments import DeploymentStartError, Launcher, RunningDeployment
from bench.result import BenchmarkResult
from bench.runner import RunConfig, run_benchmark
from bench.tokenizer import BenchTokenizer

if TYPE_CHECKING:
    from splitserve.config import ClusterConfig


@dataclass(frozen=True)
class Deployment:
    """One deployment to benchmark: its label, its config file, and the parsed config, or (None
    and) `error` saying why the file did not load."""

    label: str
    config_file: str
    config: ClusterConfig | None
    error: str = ""


@dataclass(frozen=True)
class Workload:
    """What every deployment is sent: one dataset, one run config, one tokenizer (or None)."""

    dataset: Dataset
    run_config: RunConfig
    tokenizer: BenchTokenizer | None = None


@dataclass(frozen=True)
class DeploymentOutcome:
    """What happened to one deployment: its `result`, or the `error` that stopped it.

    `stage` says how far it got: "config" (did not load), "start" (did not come up),
    "benchmark" (the run raised), "interrupted", or "done" (with a result; its requests may
    still have failed, as the result's summary says).
    """

    label: str
    config_file: str
    stage: str
    result: BenchmarkResult | None = None
    error: str = ""
    gateway_url: str | None = None

    @property
    def failure(self) -> str:
        """Why it did not run, in words ("did not start: ..."); empty for one that ran."""
        if self.result is not None:
            return ""
        words = _FAILURE_WORDS.get(self.stage, self.stage)
        return f"{words}: {self.error}" if self.error else words


_FAILURE_WORDS = {
    "config": "config did not load",
    "start": "did not start",
    "benchmark": "benchmark failed",
    "interrupted": "interrupted",
}


class ComparisonInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) ended the comparison; `outcomes` holds every deployment's so far."""

    def __init__(self, outcomes: list[DeploymentOutcome]) -> None:
        super().__init__("interrupted")
        self.outcomes = outcomes


def compare_deployments(
    deployments: Sequence[Deployment],
    workload: Workload,
    launcher: Launcher,
    say: Callable[[str], None] = print,
) -> list[DeploymentOutcome]:
    """Run `workload` against each deployment in order; a Ctrl-C stops the one running, then
    raises `ComparisonInterrupted` (a `KeyboardInterrupt`) holding the outcomes so far."""
    outcomes: list[DeploymentOutcome] = []
    for number, deployment in enumerate(deployments, start=1):
        say(f"[{number}/{len(deployments)}] {deployment.label} ({deployment.config_file})")
        try:
            outcome = _run_one(deployment, workload, launcher, say)
        except KeyboardInterrupt:
            outcomes.append(DeploymentOutcome(deployment.label, deployment.config_file, "interrupted"))
            raise ComparisonInterrupted(outcomes) from None
        if outcome.failure:
            say(f"  {deployment.label}: {outcome.failure}")
        outcomes.append(outcome)
    return outcomes


def _run_one(
    deployment: Deployment, workload: Workload, launcher: Launcher, say: Callable[[str], None]
) -> DeploymentOutcome:
    label, config_file, config = deployment.label, deployment.config_file, deployment.config
    if config is None:
        return DeploymentOutcome(label, config_file, "config", error=deployment.error)
    say(f"  starting {config.mode} deployment of {config.model.served_name}...")
    try:
        running = launcher.start(config)
    except DeploymentStartError as exc:
        return DeploymentOutcome(label, config_file, "start", error=str(exc))
    url: str | None = None
    try:
        url = running.gateway_url
        say(f"  healthy; gateway {url}; sending {workload.dataset.num_requests:,} requests")
        result = asyncio.run(
            run_benchmark(workload.dataset, _run_config(workload, config, url), workload.tokenizer)
        )
        say(f"  {label}: {result.summary.completed:,} completed, {result.summary.failed:,} failed")
    except Exception as exc:  # the benchmark broke, not one request: record it and go on
        return DeploymentOutcome(
            label, config_file, "benchmark", error=f"{type(exc).__name__}: {exc}", gateway_url=url
        )
    finally:
        _stop(running, say)
    result = replace(result, arguments={**result.arguments, "label": label, "config_file": config_file})
    return DeploymentOutcome(label, config_file, "done", result=result, gateway_url=url)


def _run_config(workload: Workload, config: ClusterConfig, url: str) -> RunConfig:
    """The shared run config aimed at this deployment: its URL, model name and (unless one was
    given) its gateway's first API key."""
    from splitserve.config import gateway_api_keys

    keys = gateway_api_keys(config.gateway)  # the deployment runs here: its variable or file too
    api_key = workload.run_config.api_key or (keys[0] if keys else None)
    return replace(workload.run_config, base_url=url, model=config.model.served_name, api_key=api_key)


def _stop(running: RunningDeployment, say: Callable[[str], None]) -> None:
    say("  stopping...")
    with _interrupts_held():
        running.stop()
    say("  stopped")


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block's duration, then raise KeyboardInterrupt if one came."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        raise KeyboardInterrupt
