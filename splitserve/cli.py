"""The `splitserve` command line.

Each subcommand is a `Command` in `COMMANDS`: a help line, a function that adds its arguments
to its subparser, and a function that runs it and returns the exit status. To add one, write
those two functions and add one entry to the table. Importing this module stays torch-free;
commands import what they need when they run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Command:
    """One subcommand: `add_arguments(parser)` declares its options, `run(args)` returns the exit status."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_make_tiny_model_arguments(parser: argparse.ArgumentParser) -> None:
    from splitserve.tiny_model import PRESETS

    parser.add_argument("dir", help="folder to write the checkpoint into (created if missing)")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="tiny", help="model size (default: tiny)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed; the same seed gives the same bytes")


def _run_make_tiny_model(args: argparse.Namespace) -> int:
    from splitserve.tiny_model import make_tiny_model, num_checkpoint_elements

    path = make_tiny_model(args.dir, preset=args.preset, seed=args.seed)
    print(f"{path} ({args.preset}, seed {args.seed}): {num_checkpoint_elements(path):,} parameters")
    return 0


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    # splitserve.demo declares its own options; its module is torch-free at import.
    demo = _import_demo()
    if demo is not None and hasattr(demo, "add_arguments"):
        demo.add_arguments(parser)


def _run_demo(args: argparse.Namespace) -> int:
    demo = _import_demo()
    if demo is None:
        print("splitserve demo: this build has no splitserve/demo.py", file=sys.stderr)
        return 2
    status = demo.main(args)
    return int(status) if status is not None else 0


def _import_demo() -> ModuleType | None:
    try:
        return importlib.import_module("splitserve.demo")
    except ModuleNotFoundError as exc:
        if exc.name != "splitserve.demo":
            raise
        return None


COMMANDS: dict[str, Command] = {
    "make-tiny-model": Command(
        help="write a random tiny kimi_linear checkpoint with its tokenizer",
        add_arguments=_add_make_tiny_model_arguments,
        run=_run_make_tiny_model,
    ),
    "demo": Command(help="run the local demo", add_arguments=_add_demo_arguments, run=_run_demo),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve", description="Disaggregated serving for Kimi Linear models."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        subparser = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`), run the chosen subcommand, return its exit status."""
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
