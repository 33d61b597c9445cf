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

    try:
        path = make_tiny_model(args.dir, preset=args.preset, seed=args.seed)
    except OSError as exc:  # a folder that cannot be created or written: one line, not a traceback
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != args.dir else ""
        print(
            f"splitserve make-tiny-model: cannot write a checkpoint to {args.dir}: "
            f"{exc.strerror or exc}{where}; choose a folder you can write",
            file=sys.stderr,
        )
        return 1
    print(f"{path} ({args.preset}, seed {args.seed}): {num_checkpoint_elements(path):,} parameters")
    return 0


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    # cli.demo declares its own options; its module is torch-free at import.
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
        return importlib.import_module("cli.demo")
    except ModuleNotFoundError as exc:
        if exc.name != "cli.demo":
            raise
        return None


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="validate a cluster config file and print it resolved")
    check.add_argument("file", help="the YAML file to check")
    actions.add_parser("default", help="print the embedded default config")
    from cli.config_plan import add_plan_arguments

    add_plan_arguments(
        actions.add_parser(
            "plan",
            help="print each pool's memory plan (weights, activations, KV blocks, state slots) and "
            "whether it fits, from the checkpoint's config.json alone",
        )
    )


def _run_config(args: argparse.Namespace) -> int:
    from splitserve.config import ConfigError, default_config, load_config

    if args.config_action == "plan":
        from cli.config_plan import run_plan

        return run_plan(args)
    if args.config_action == "default":
        print(default_config().to_yaml(), end="")
        return 0
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        print(f"splitserve config check: {exc}", file=sys.stderr)
        return 1
    print(config.to_yaml(), end="")
    summary = f"{args.file}: OK ({config.mode}, pools: {', '.join(config.pool_names)})"
    from deploy.launcher import ClusterError, check_local_model

    try:
        check_local_model(config)
    except ClusterError as exc:  # valid for `up --address` to a cluster whose nodes hold the checkpoint
        summary += f", but {exc}: `splitserve up` without --address refuses it here"
    print(summary, file=sys.stderr)
    return 0


def _add_address_argument(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--address",
        default=None,
        help=f"Ray cluster address (host:port of its GCS, or ray://head:10001); default: {default}",
    )


def _add_name_argument(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--name", default=None, help=help)


def _add_up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="cluster config YAML (default: the embedded default)")
    _add_address_argument(parser, "$RAY_ADDRESS, else a new local Ray with room for twice the config")
    _add_name_argument(
        parser,
        "this deployment's name on this machine and its Ray namespace (default: default); "
        "give each deployment sharing the machine or the Ray cluster its own",
    )
    parser.add_argument(
        "--host", default=None, help="the gateway's address (default: the config's gateway.host)"
    )
    parser.add_argument(
        "--port", type=int, default=None, help="the gateway's port (default: the config's gateway.port)"
    )


def _run_up(args: argparse.Namespace) -> int:
    from splitserve.config import ConfigError, default_config, load_config, with_gateway_address

    try:
        config = load_config(args.config) if args.config else default_config()
        config = with_gateway_address(config, host=args.host, port=args.port)
    except ConfigError as exc:
        print(f"splitserve up: {exc}", file=sys.stderr)
        return 2
    from deploy.local_deployments import DEFAULT_NAME
    from deploy.serve import serve_forever

    return serve_forever(config, address=args.address, name=args.name or DEFAULT_NAME)


_WHICH_DEPLOYMENT = "the deployment `splitserve up --name NAME` started on this machine"
_OR_THE_RECORDED_ONE = "the Ray of the deployment `splitserve up` started on this machine, else $RAY_ADDRESS"


def _add_status_arguments(parser: argparse.ArgumentParser) -> None:
    _add_name_argument(parser, f"{_WHICH_DEPLOYMENT} (with --address: its namespace there)")
    _add_address_argument(parser, _OR_THE_RECORDED_ONE)
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")


def _run_status(args: argparse.Namespace) -> int:
    import json

    from deploy.control import ClusterError, fetch_status
    from deploy.report import status_table

    try:
        status = fetch_status(args.name, args.address)
    except ClusterError as exc:
        print(f"splitserve status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else status_table(status))
    return 0 if status["healthy"] else 3


def _add_resize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pool", help="the pool to resize: prefill or decode")
    parser.add_argument("replicas", type=int, help="the new number of replicas (at least 1)")
    _add_name_argument(parser, f"{_WHICH_DEPLOYMENT} (with --address: its namespace there)")
    _add_address_argument(parser, _OR_THE_RECORDED_ONE)


def _run_resize(args: argparse.Namespace) -> int:
    from deploy.control import ClusterError, resize_pool
    from deploy.report import status_line

    print(
        f"resizing {args.pool} to {args.replicas}; replicas removed first finish the requests they hold "
        "(up to health.drain_timeout_s)...",
        file=sys.stderr,
        flush=True,
    )
    try:
        status = resize_pool(args.pool, args.replicas, args.name, args.address)
    except ClusterError as exc:
        print(f"splitserve resize: {exc}", file=sys.stderr)
        return 1
    print(status_line(status))
    return 0


def _add_apply_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the cluster config YAML the deployment should run")
    _add_name_argument(parser, f"{_WHICH_DEPLOYMENT} (with --address: its namespace there)")
    _add_address_argument(parser, _OR_THE_RECORDED_ONE)
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would change (or why it cannot), change nothing"
    )


def _run_apply(args: argparse.Namespace) -> int:
    from cli.apply import run_apply

    return run_apply(args)


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.cli import add_bench_arguments

    add_bench_arguments(parser)


def _run_bench(args: argparse.Namespace) -> int:
    from bench.cli import run_bench

    return run_bench(args)


COMMANDS: dict[str, Command] = {
    "make-tiny-model": Command(
        help="write a random tiny kimi_linear checkpoint with its tokenizer",
        add_arguments=_add_make_tiny_model_arguments,
        run=_run_make_tiny_model,
    ),
    "demo": Command(help="run the local demo", add_arguments=_add_demo_arguments, run=_run_demo),
    "up": Command(
        help="start a deployment from a cluster config and serve until Ctrl-C or SIGTERM",
        add_arguments=_add_up_arguments,
        run=_run_up,
    ),
    "status": Command(
        help="show the running deployment's pools, health and load",
        add_arguments=_add_status_arguments,
        run=_run_status,
    ),
    "resize": Command(
        help="change the number of replicas of a running deployment's pool",
        add_arguments=_add_resize_arguments,
        run=_run_resize,
    ),
    "apply": Command(
        help="change a running deployment to a new config: grow, shrink or roll its pools, never "
        "failing a request (what cannot change live is refused before anything changes)",
        add_arguments=_add_apply_arguments,
        run=_run_apply,
    ),
    "config": Command(
        help="check a cluster config file (config check FILE), plan its memory (config plan FILE) "
        "or print the default (config default)",
        add_arguments=_add_config_arguments,
        run=_run_config,
    ),
    "bench": Command(
        help="benchmark a serving endpoint (bench serve) or compare deployments (bench compare)",
        add_arguments=_add_bench_arguments,
        run=_run_bench,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve", description="Disaggregated serving for Kimi Linear models."
    )
    add_subcommands(parser, COMMANDS, dest="command", metavar="COMMAND")
    return parser


def add_subcommands(
    parser: argparse.ArgumentParser, commands: dict[str, Command], *, dest: str, metavar: str
) -> None:
    """One required subparser per entry of `commands`, its name stored in `args.<dest>`."""
    subparsers = parser.add_subparsers(dest=dest, metavar=metavar, required=True)
    for name, command in commands.items():
        subparser = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(subparser)


# What only the `engine` extra installs: a command that needs one of them says so in one line.
ENGINE_MODULES = frozenset({"torch", "transformers", "safetensors", "triton"})


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`), run the chosen subcommand, return its exit status."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in ENGINE_MODULES:
            raise
        print(
            f"splitserve {args.command}: needs the engine extra ({missing} is not installed here): "
            "pip install 'splitserve[engine]' (with torch for this machine's hardware first: "
            'deploy/README.md, "Installing")',
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
