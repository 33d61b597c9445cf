"""`splitserve bench serve`: benchmark any OpenAI-compatible server with a synthetic workload.

`add_serve_arguments(parser)` declares the options and `run_serve(args)` runs them, so other
commands can reuse both. Importing this module stays cheap: the benchmark's machinery (httpx,
numpy, tqdm, tokenizers) loads inside `run_serve`.
"""

from __future__ import annotations

import argparse
import sys

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
    add_request_options(server, tokenizer_default="--model, if it is one")
    add_load_options(parser)
    report = parser.add_argument_group("report")
    report.add_argument(
        "--result-file", default=None, help="write the summary and every request's timings here (JSON)"
    )
    add_report_options(report)
    add_dataset_options(parser)


def run_serve(args: argparse.Namespace) -> int:
    """Run the benchmark `args` describe; 0 when every request completed, 1 when any failed, 2 on bad options."""
    import asyncio
    from dataclasses import replace

    from bench.datasets import build_dataset
    from bench.report import format_summary
    from bench.runner import run_benchmark
    from bench.tokenizer import resolve_tokenizer

    try:
        tokenizer = resolve_tokenizer(args.tokenizer, args.model)
        check_chat_tokenizer(args.endpoint, tokenizer)
        config = run_config_from_args(
            args, base_url=args.base_url, model=args.served_model_name or args.model
        )
        dataset = build_dataset(args, tokenizer)
        check_dataset_endpoint(dataset, args.endpoint)
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
    result = replace(result, arguments=recorded_arguments(args))
    print(format_summary(result.summary))
    if args.result_file:
        print(f"results: {result.save(args.result_file)}")
    return 0 if result.summary.failed == 0 else 1
