"""`splitserve bench compare`: one workload against several deployments, side by side.

For each `--config` in turn: bring the deployment up (its own local Ray, or `--address`), wait
until it is healthy, send it the identical workload (the same dataset object, seed and arrival
times), take it down; then print a table with a column per deployment and ratios against the
first, and write the results, `comparison.json` and plots into `--output-dir`. A deployment
that fails to load or start is reported and the others still run; the exit status is then 1.
Importing this module stays cheap: Ray, httpx and matplotlib load inside `run_compare`.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from bench.options import (
    add_dataset_options,
    add_load_options,
    add_report_options,
    add_request_options,
    check_chat_tokenizer,
    check_dataset_endpoint,
    recorded_arguments,
    run_config_from_args,
)

if TYPE_CHECKING:
    from bench.compare_run import Deployment
    from bench.deployments import Launcher
    from bench.tokenizer import BenchTokenizer

EXIT_INTERRUPTED = 130


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every `bench compare` option on `parser`."""
    deployments = parser.add_argument_group("deployments")
    deployments.add_argument(
        "--config",
        dest="configs",
        action="append",
        required=True,
        metavar="FILE",
        help="a cluster config YAML; repeat for each deployment, run in order (the first is the baseline)",
    )
    deployments.add_argument(
        "--label",
        dest="labels",
        action="append",
        default=None,
        metavar="NAME",
        help="the name of each --config's deployment, in the same order (default: the file's stem)",
    )
    deployments.add_argument(
        "--address",
        default=None,
        help="Ray cluster to start each deployment in (default: $RAY_ADDRESS, else a new local Ray each)",
    )
    requests = parser.add_argument_group("requests")
    add_request_options(
        requests,
        tokenizer_default="the first config's model folder, if it has one",
        api_key_default="$OPENAI_API_KEY, else each gateway's first api_keys entry",
    )
    add_load_options(parser)
    report = parser.add_argument_group("report")
    report.add_argument(
        "--output-dir", required=True, help="folder for each result, comparison.json and the plots"
    )
    add_report_options(report)
    add_dataset_options(parser)


def make_launcher(address: str | None) -> Launcher:
    """The launcher the deployments are started with (tests put a fake in its place)."""
    from bench.deployments import RayLauncher

    return RayLauncher(address)


def run_compare(args: argparse.Namespace) -> int:
    """Run the comparison; 0 when every deployment ran every request, 1 when any did not, 2 on
    bad options, 130 when interrupted (what finished is still written)."""
    from bench.compare_output import comparison_text, write_comparison
    from bench.compare_run import ComparisonInterrupted, Workload, compare_deployments
    from bench.datasets import build_dataset

    try:
        labels = deployment_labels(args.configs, args.labels)
        deployments = [_load(label, path) for label, path in zip(labels, args.configs)]
        tokenizer = _tokenizer(args.tokenizer, deployments)
        check_chat_tokenizer(args.endpoint, tokenizer)
        run_config = run_config_from_args(args, base_url="", model="")  # each deployment fills these in
        dataset = build_dataset(args, tokenizer)
        check_dataset_endpoint(dataset, args.endpoint)
    except ValueError as exc:
        print(f"splitserve bench compare: {exc}", file=sys.stderr)
        return 2
    print(
        f"{dataset.name}: {dataset.num_requests:,} requests ({args.endpoint}) to each of "
        f"{len(deployments)} deployments: {', '.join(labels)}",
        flush=True,
    )
    status = 0
    with _sigterm_interrupts():
        try:
            outcomes = compare_deployments(
                deployments, Workload(dataset, run_config, tokenizer), make_launcher(args.address), _say
            )
        except ComparisonInterrupted as exc:
            print("interrupted; every deployment started is stopped", file=sys.stderr)
            outcomes, status = exc.outcomes, EXIT_INTERRUPTED
    print(comparison_text(outcomes))
    files = write_comparison(outcomes, args.output_dir, recorded_arguments(args))
    print(f"results: {files.comparison} ({len(files.results)} results, {len(files.plots)} plots)")
    if status:
        return status
    clean = all(o.result is not None and o.result.summary.failed == 0 for o in outcomes)
    return 0 if clean else 1


def deployment_labels(config_files: Sequence[str], labels: Sequence[str] | None) -> list[str]:
    """`labels` checked (one per config, unique, non-empty), or each file's stem, made unique
    with -2, -3... where two stems agree."""
    if labels is not None:
        if len(labels) != len(config_files):
            raise ValueError(
                f"{len(labels)} --label for {len(config_files)} --config; give one label per config, or none"
            )
        if any(not label.strip() for label in labels) or len(set(labels)) != len(labels):
            raise ValueError(f"--label values must be non-empty and distinct (got {list(labels)})")
        return list(labels)
    out: list[str] = []
    for path in config_files:
        stem = Path(path).stem or "deployment"
        label, n = stem, 2
        while label in out:
            label, n = f"{stem}-{n}", n + 1
        out.append(label)
    return out


def _load(label: str, path: str) -> Deployment:
    from bench.compare_run import Deployment
    from splitserve.config import ConfigError, load_config

    try:
        return Deployment(label, path, load_config(path))
    except ConfigError as exc:
        return Deployment(label, path, None, error=str(exc))


def _tokenizer(tokenizer: str | None, deployments: Sequence[Deployment]) -> BenchTokenizer | None:
    """--tokenizer, else the tokenizer in the first loaded config's model folder, else None."""
    from bench.tokenizer import resolve_tokenizer

    paths = [d.config.model.path for d in deployments if d.config is not None and d.config.model.path]
    if tokenizer is None and not paths:
        return None
    return resolve_tokenizer(tokenizer, paths[0] if paths else "")


def _say(line: str) -> None:
    print(line, flush=True)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the block, as Ctrl-C does, so it stops what is running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
