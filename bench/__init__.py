"""`splitserve bench`: serving benchmarks that drive any OpenAI-compatible server over HTTP.

The pieces, each reusable on its own (none imports torch):

* `datasets`: seeded synthetic workloads (`build_dataset`): random, shared-prefix, multi-turn.
* `runner`: `run_benchmark(dataset, RunConfig(...))` streams them at a server, returns a
  `BenchmarkResult` (`result`) with every request's `RequestRecord` (`records`).
* `metrics`: `summarize(records, duration_s, slos_ms)` gives the `Summary` (TTFT, TPOT, ITL,
  E2E latency percentiles, throughputs, goodput); `report` prints it as a table.
* `serve`: the `splitserve bench serve` command (`add_serve_arguments`, `run_serve`); `options`
  holds the option groups it shares with `compare`; `cli` holds the table of bench subcommands.
* `compare`: `splitserve bench compare`: each deployment config brought up in turn (`deployments`),
  sent the same workload (`compare_run`), then a side-by-side table (`compare_table`), JSON and
  plots (`compare_output`, `plots`).
"""
