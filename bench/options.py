"""The command-line options `bench serve` and `bench compare` share, and the `RunConfig` they give.

Each `add_*` function declares one group of options; `run_config_from_args` reads them back.
Importing this module stays cheap: the runner (httpx, tqdm) loads inside `run_config_from_args`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import TYPE_CHECKING, Any

from bench.api import ENDPOINTS
from bench.datasets.config import DATASET_NAMES, DatasetConfig

if TYPE_CHECKING:
    from bench.datasets import Dataset
    from bench.runner import RunConfig
    from bench.tokenizer import BenchTokenizer

_DEFAULTS = DatasetConfig()


def add_request_options(
    group: argparse._ArgumentGroup, *, tokenizer_default: str, api_key_default: str = "$OPENAI_API_KEY"
) -> None:
    """How each request is sent: --endpoint, --api-key, --tokenizer, --request-timeout-s, --extra-body.

    `tokenizer_default` and `api_key_default` say in the help where those come from when not given.
    """
    group.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="completions",
        help="which OpenAI endpoint (default: completions)",
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help=f"bearer token (default: {api_key_default})",
    )
    group.add_argument(
        "--tokenizer", default=None, help=f"folder with tokenizer.json (default: {tokenizer_default})"
    )
    group.add_argument(
        "--request-timeout-s", type=float, default=6 * 3600.0, help="per-request timeout (default: 6 h)"
    )
    group.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help="JSON merged into every request body, e.g. '{\"temperature\": 0}'",
    )


def add_load_options(parser: argparse.ArgumentParser) -> None:
    """The "load" group: which dataset, how many, how fast, how many at once, the seed."""
    load = parser.add_argument_group("load")
    load.add_argument("--dataset", choices=DATASET_NAMES, default="random", help="workload (default: random)")
    load.add_argument(
        "--num-prompts", type=int, default=None, help="requests in the random dataset (default: 1000)"
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests (sessions for multi-turn) per second; inf sends all at once (default)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier (default: 1)",
    )
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight at once (default: no cap)"
    )
    load.add_argument(
        "--think-time-s",
        type=float,
        default=0.0,
        help="multi-turn: seconds a session waits after a reply before its next turn, as a user reading "
        "it (holds no request slot; default: 0, back to back)",
    )
    load.add_argument(
        "--seed", type=int, default=0, help="seed of the prompts, lengths and arrivals (default: 0)"
    )
    load.add_argument(
        "--vocab-size",
        type=int,
        default=_DEFAULTS.vocab_size,
        help="token-id prompts draw ids from [3, this) (default: %(default)s)",
    )


def add_report_options(group: argparse._ArgumentGroup) -> None:
    """--goodput SLOs and --disable-tqdm (where the results go is each command's own option)."""
    group.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:5000",
    )
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


# Per dataset: its argument group's title, then (flag, type, help) for each of its sizes; each
# default is the DatasetConfig field the flag names.
_DATASET_OPTIONS: tuple[tuple[str, tuple[tuple[str, type, str], ...]], ...] = (
    (
        "random dataset",
        (
            ("--random-input-len", int, "prompt tokens"),
            ("--random-output-len", int, "output tokens"),
            ("--random-range-ratio", float, "lengths uniform in [L(1-r), L(1+r)]"),
            ("--random-prefix-len", int, "tokens of a prefix all prompts share, added to the input length"),
        ),
    ),
    (
        "shared-prefix dataset (num-groups x prompts-per-group requests)",
        (
            ("--gsp-num-groups", int, "groups, one system prompt each"),
            ("--gsp-prompts-per-group", int, "questions per group"),
            ("--gsp-system-prompt-len", int, "system prompt tokens"),
            ("--gsp-question-len", int, "question tokens"),
            ("--gsp-output-len", int, "output tokens"),
        ),
    ),
    (
        "multi-turn and multi-turn-ids datasets (num-sessions x turns requests; multi-turn needs a tokenizer)",
        (
            ("--mt-num-sessions", int, "concurrent conversations"),
            ("--mt-turns", int, "user turns per conversation"),
            ("--mt-user-len", int, "tokens of each user message"),
            ("--mt-output-len", int, "output tokens of each reply"),
        ),
    ),
)


def add_dataset_options(parser: argparse.ArgumentParser) -> None:
    """One group per dataset: the random, shared-prefix and multi-turn sizes."""
    for title, options in _DATASET_OPTIONS:
        group = parser.add_argument_group(title)
        for flag, kind, help_text in options:
            default = getattr(_DEFAULTS, flag.removeprefix("--").replace("-", "_"))
            group.add_argument(flag, type=kind, default=default, help=f"{help_text} (default: %(default)s)")


def run_config_from_args(args: argparse.Namespace, *, base_url: str, model: str) -> RunConfig:
    """The `RunConfig` the request, load and report options describe; ValueError on bad ones."""
    from bench.metrics import parse_slos
    from bench.runner import RunConfig

    return RunConfig(
        base_url=base_url,
        model=model,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        think_time_s=args.think_time_s,
        seed=args.seed,
        slos_ms=parse_slos(args.goodput),
        api_key=args.api_key,
        request_timeout_s=args.request_timeout_s,
        extra_body=args.extra_body,
        disable_tqdm=args.disable_tqdm,
    )


def check_chat_tokenizer(endpoint: str, tokenizer: BenchTokenizer | None) -> None:
    """Raise ValueError when the chat endpoint is asked for without a tokenizer to write text."""
    if endpoint == "chat" and tokenizer is None:
        raise ValueError(
            "--endpoint chat sends text, which needs a tokenizer: pass --tokenizer PATH "
            "(a folder with tokenizer.json), or a local --model folder that has one"
        )


def check_dataset_endpoint(dataset: Dataset, endpoint: str) -> None:
    """Raise ValueError when `endpoint` cannot send `dataset`'s prompts: chat takes text only."""
    if endpoint != "chat":
        return
    if any(not isinstance(r.prompt, str) for r in dataset.requests):
        raise ValueError(
            "the chat endpoint needs text prompts; build the dataset with a tokenizer (--tokenizer PATH)"
        )
    if any(isinstance(t.user_message, tuple) for s in dataset.sessions for t in s.turns):
        raise ValueError(
            f"the {dataset.name} dataset sends token ids, which only the completions endpoint takes; "
            "drop --endpoint chat or use the multi-turn dataset"
        )


def recorded_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed arguments as a result keeps them: everything but the API key and callables."""
    return {k: v for k, v in vars(args).items() if k != "api_key" and not callable(v)}
