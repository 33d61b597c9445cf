"""What `bench compare` leaves in its output folder, and the table it prints.

`write_comparison(outcomes, out_dir, arguments)` writes each deployment's full result
(`<label>.json`, a `BenchmarkResult`), `comparison.json` (every deployment's status, summary and
result file, and the table's rows with their ratios) and the plots (`latency_cdf.png`,
`throughput.png`), and returns the paths. Deployments that did not run appear in
`comparison.json` with their error and nowhere else.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.compare_run import DeploymentOutcome
from bench.compare_table import comparison_rows, format_comparison
from bench.plots import LATENCY_CDF_FILE, THROUGHPUT_FILE, plot_latency_cdfs, plot_throughput
from bench.result import BenchmarkResult, jsonable

COMPARISON_FORMAT = "splitserve-bench-compare/1"
COMPARISON_FILE = "comparison.json"


@dataclass(frozen=True)
class ComparisonFiles:
    """The files one comparison wrote: `comparison.json`, each label's result file, the plots."""

    comparison: Path
    results: dict[str, Path]
    plots: tuple[Path, ...]


def comparison_text(outcomes: Sequence[DeploymentOutcome]) -> str:
    """The side-by-side table of the deployments that ran, then a line per one that did not."""
    ran = _ran(outcomes)
    lines = []
    if ran:
        lines.append(format_comparison(list(ran), [r.summary for r in ran.values()]))
    else:
        lines.append("no deployment ran the benchmark")
    lines += [f"{o.label}: {o.failure}" for o in outcomes if o.result is None]
    return "\n".join(lines)


def write_comparison(
    outcomes: Sequence[DeploymentOutcome], out_dir: str | Path, arguments: dict[str, Any]
) -> ComparisonFiles:
    """Write the results, `comparison.json` and (where any deployment ran) the plots into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ran = _ran(outcomes)
    results: dict[str, Path] = {}
    for label, result in ran.items():
        results[label] = result.save(out / _result_name(label, taken={p.name for p in results.values()}))
    plots: tuple[Path, ...] = ()
    if ran:
        plots = (
            plot_latency_cdfs({label: r.records for label, r in ran.items()}, out / LATENCY_CDF_FILE),
            plot_throughput({label: r.summary for label, r in ran.items()}, out / THROUGHPUT_FILE),
        )
    document = {
        "format": COMPARISON_FORMAT,
        "arguments": arguments,
        "baseline": next(iter(ran), None),
        "deployments": [_deployment_entry(o, results.get(o.label)) for o in outcomes],
        "rows": _rows(ran),
        "plots": [p.name for p in plots],
    }
    comparison = out / COMPARISON_FILE
    comparison.write_text(json.dumps(jsonable(document), indent=2) + "\n", encoding="utf-8")
    return ComparisonFiles(comparison, results, plots)


def _deployment_entry(outcome: DeploymentOutcome, result_file: Path | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "label": outcome.label,
        "config_file": outcome.config_file,
        "stage": outcome.stage,
        "error": outcome.error,
        "gateway_url": outcome.gateway_url,
        "result_file": result_file.name if result_file else None,
        "summary": None,
    }
    if outcome.result is not None:
        entry["dataset"] = outcome.result.dataset
        entry["started_at"] = outcome.result.started_at
        entry["summary"] = outcome.result.summary.to_dict()
    return entry


def _rows(ran: dict[str, BenchmarkResult]) -> list[dict[str, Any]]:
    if not ran:
        return []
    labels = list(ran)
    return [
        {
            "name": row.name,
            "values": dict(zip(labels, row.values)),
            "ratios": dict(zip(labels[1:], row.ratios)),
        }
        for row in comparison_rows([r.summary for r in ran.values()])
    ]


def _ran(outcomes: Sequence[DeploymentOutcome]) -> dict[str, BenchmarkResult]:
    """The results of the deployments that ran, by label, in order (labels are unique)."""
    return {o.label: o.result for o in outcomes if o.result is not None}


def _result_name(label: str, taken: set[str]) -> str:
    """`<label>.json` with anything but letters, digits, dot, dash and underscore replaced."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or "deployment"
    if stem == Path(COMPARISON_FILE).stem:
        stem += "-result"
    name, n = f"{stem}.json", 2
    while name in taken:
        name, n = f"{stem}-{n}.json", n + 1
    return name
