"""`splitserve bench`: the table of benchmark subcommands.

Each entry is a `cli.main.Command` (help, add_arguments, run); to add a subcommand, write
its two functions and add one entry to `SUBCOMMANDS`. Importing this module stays cheap.
"""

from __future__ import annotations

import argparse

from bench.compare import add_compare_arguments, run_compare
from bench.serve import add_serve_arguments, run_serve
from cli.main import Command, add_subcommands

SUBCOMMANDS: dict[str, Command] = {
    "serve": Command(
        help="drive an OpenAI-compatible server with a synthetic workload; report TTFT, TPOT, ITL, throughput",
        add_arguments=add_serve_arguments,
        run=run_serve,
    ),
    "compare": Command(
        help="bring up each deployment config in turn, send each the same workload, compare them side by side",
        add_arguments=add_compare_arguments,
        run=run_compare,
    ),
}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """One subparser per entry of `SUBCOMMANDS`."""
    add_subcommands(parser, SUBCOMMANDS, dest="bench_command", metavar="BENCHMARK")


def run_bench(args: argparse.Namespace) -> int:
    return SUBCOMMANDS[args.bench_command].run(args)
