"""`splitserve bench serve`: benchmark any OpenAI-compatible server with a synthetic workload.

`add_serve_arguments(parser)` declares the options and `run_serve(args)` runs them, so other
commands can reuse both. Importing this module stays cheap: the benchmark's machinery (httpx,
numpy, tqdm, tokenizers) loads inside `run_serve`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from splitserve.bench.api import ENDPOINTS
from splitserve.bench.datasets.config import DATASET_NAMES, DatasetConfig

_DEFAULTS = DatasetConfig()


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every `bench serve` option on `parser`."""
    server = parser.add_argument_group("server")
    server.add_argument(
        "--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (/v1 is added if missing)"
    )
    server.add_argument(
        "--model", required=True, help="model name to request; a local folder also gives the tokenizer"
    )
    server.add_argument(
        "--served-model-name", default=None, help="name sent in requests when it differs from --model"
    )
    server.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="completions",
        help="which OpenAI endpoint (default: completions)",
    )
    server.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    server.add_argument(
        "--tokenizer", default=None, help="folder with tokenizer.json (default: --model, if it is one)"
    )
    server.add_argument(
        "--request-timeout-s", type=float, default=6 * 3600.0, help="per-request timeout (default: 6 h)"
    )
    server.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help="JSON merged into every request body, e.g. '{\"temperature\": 0}'",
    )

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
        "--seed", type=int, default=0, help="seed of the prompts, lengths and arrivals (default: 0)"
    )
    load.add_argument(
        "--vocab-size",
        type=int,
        default=_DEFAULTS.vocab_size,
        help="token-id prompts draw ids from [3, this) (default: %(default)s)",
    )

    report = parser.add_argument_group("report")
    report.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:5000",
    )
    report.add_argument(
        "--result-file", default=None, help="write the summary and every request's timings here (JSON)"
    )
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

    _add_dataset_options(parser)


def _add_dataset_options(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    random = parser.add_argument_group("random dataset")
    random.add_argument(
        "--random-input-len",
        type=int,
        default=d.random_input_len,
        help="prompt tokens (default: %(default)s)",
    )
    random.add_argument(
        "--random-output-len",
        type=int,
        default=d.random_output_len,
        help="output tokens (default: %(default)s)",
    )
    random.add_argument(
        "--random-range-ratio",
        type=float,
        default=d.random_range_ratio,
        help="lengths uniform in [L(1-r), L(1+r)] (default: %(default)s)",
    )
    random.add_argument(
        "--random-prefix-len",
        type=int,
        default=d.random_prefix_len,
        help="tokens of a prefix all prompts share, added to the input length (default: %(default)s)",
    )

    gsp = parser.add_argument_group("shared-prefix dataset (num-groups x prompts-per-group requests)")
    gsp.add_argument(
        "--gsp-num-groups",
        type=int,
        default=d.gsp_num_groups,
        help="groups, one system prompt each (default: %(default)s)",
    )
    gsp.add_argument(
        "--gsp-prompts-per-group",
        type=int,
        default=d.gsp_prompts_per_group,
        help="questions per group (default: %(default)s)",
    )
    gsp.add_argument(
        "--gsp-system-prompt-len",
        type=int,
        default=d.gsp_system_prompt_len,
        help="system prompt tokens (default: %(default)s)",
    )
    gsp.add_argument(
        "--gsp-question-len",
        type=int,
        default=d.gsp_question_len,
        help="question tokens (default: %(default)s)",
    )
    gsp.add_argument(
        "--gsp-output-len", type=int, default=d.gsp_output_len, help="output tokens (default: %(default)s)"
    )

    mt = parser.add_argument_group("multi-turn dataset (num-sessions x turns requests; needs a tokenizer)")
    mt.add_argument(
        "--mt-num-sessions",
        type=int,
        default=d.mt_num_sessions,
        help="concurrent conversations (default: %(default)s)",
    )
    mt.add_argument(
        "--mt-turns", type=int, default=d.mt_turns, help="user turns per conversation (default: %(default)s)"
    )
    mt.add_argument(
        "--mt-user-len",
        type=int,
        default=d.mt_user_len,
        help="tokens of each user message (default: %(default)s)",
    )
    mt.add_argument(
        "--mt-output-len",
        type=int,
        default=d.mt_output_len,
        help="output tokens of each reply (default: %(default)s)",
    )


def run_serve(args: argparse.Namespace) -> int:
    """Run the benchmark `args` describe; 0 when every request completed, 1 when any failed, 2 on bad options."""
    import asyncio
    from dataclasses import replace

    from splitserve.bench.datasets import build_dataset
    from splitserve.bench.metrics import parse_slos
    from splitserve.bench.report import format_summary
    from splitserve.bench.runner import RunConfig, run_benchmark
    from splitserve.bench.tokenizer import resolve_tokenizer

    try:
        slos_ms = parse_slos(args.goodput)
        tokenizer = resolve_tokenizer(args.tokenizer, args.model)
        if args.endpoint == "chat" and tokenizer is None:
            raise ValueError(
                "--endpoint chat sends text, which needs a tokenizer: pass --tokenizer PATH "
                "(a folder with tokenizer.json), or a local --model folder that has one"
            )
        config = RunConfig(
            base_url=args.base_url,
            model=args.served_model_name or args.model,
            endpoint=args.endpoint,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            slos_ms=slos_ms,
            api_key=args.api_key,
            request_timeout_s=args.request_timeout_s,
            extra_body=args.extra_body,
            disable_tqdm=args.disable_tqdm,
        )
        dataset = build_dataset(args, tokenizer)
    except ValueError as exc:
        print(f"splitserve bench serve: {exc}", file=sys.stderr)
        return 2
    cap = args.max_concurrency or "none"
    print(
        f"{dataset.name}: {dataset.num_requests:,} requests to {args.base_url} ({args.endpoint}); "
        f"request rate {args.request_rate:g}/s, burstiness {args.burstiness:g}, max concurrency {cap}",
        flush=True,
    )
    result = asyncio.run(run_benchmark(dataset, config, tokenizer))
    result = replace(result, arguments=_recorded_arguments(args))
    print(format_summary(result.summary))
    if args.result_file:
        print(f"results: {result.save(args.result_file)}")
    return 0 if result.summary.failed == 0 else 1


def _recorded_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed arguments as a result keeps them: everything but the API key and callables."""
    return {k: v for k, v in vars(args).items() if k != "api_key" and not callable(v)}
