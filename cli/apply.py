"""`splitserve apply --config FILE`: converge a running deployment on a new config, step by step.

Prints the plan, then each step as the controller takes it (it reads the controller's progress
about once a second), then the status line. Exit status: 0 converged (or, with --dry-run, the
plan printed), 1 refused (nothing changed), failed part way (what ran before keeps running:
`splitserve status` shows the steps) or the deployment was not found, 2 the file is not a valid
config. Ctrl-C stops this command, not the apply: the controller carries on.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


class _StepPrinter:
    """Prints each step of the controller's progress once, as it starts and as it ends."""

    def __init__(self) -> None:
        self._plan_shown = False
        self._num_done = 0
        self._current: str | None = None

    def __call__(self, progress: dict[str, Any]) -> None:
        if not self._plan_shown and progress["in_progress"]:
            self._plan_shown = True
            _print_plan(progress["plan"])
        for step in progress["done"][self._num_done :]:
            print(f"  done: {step}", flush=True)
        self._num_done = len(progress["done"])
        if progress["step"] and progress["step"] != self._current:
            print(f"  now:  {progress['step']} ...", flush=True)
        self._current = progress["step"]

    def finish(self, progress: dict[str, Any]) -> None:
        if not self._plan_shown:
            _print_plan(progress["plan"])
        self._current = None
        self({**progress, "step": None})


def _print_plan(plan: list[str]) -> None:
    print("plan:" if plan else "plan: nothing to change", flush=True)
    for line in plan:
        print(f"  - {line}", flush=True)


def run_apply(args: argparse.Namespace) -> int:
    from deploy.control import ClusterError, apply_config
    from deploy.report import status_line
    from splitserve.config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"splitserve apply: {exc}", file=sys.stderr)
        return 2
    printer = _StepPrinter()
    try:
        result = apply_config(
            config,
            args.name,
            args.address,
            dry_run=args.dry_run,
            on_progress=None if args.dry_run else printer,
        )
    except ClusterError as exc:
        print(f"splitserve apply: {exc}", file=sys.stderr)
        return 1
    if args.dry_run:
        _print_plan(result["plan"])
        print("dry run: nothing changed", flush=True)
        return 0
    printer.finish(result["status"]["apply"])
    print(status_line(result["status"]), flush=True)
    return 0
