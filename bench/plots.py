"""PNG plots of several runs: latency CDFs, and throughput and goodput bars, one colour per run.

Drawn with matplotlib's object API on the Agg canvas, so no pyplot state or display is touched
and any number of calls may run in one process. matplotlib is the `bench` extra; it loads only
when a plot is drawn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bench.metrics import Summary
from bench.records import RequestRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LATENCY_CDF_FILE = "latency_cdf.png"
THROUGHPUT_FILE = "throughput.png"
_LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def latency_samples_ms(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Every successful request's TTFT, TPOT and E2E latency, and every ITL gap, in milliseconds."""
    done = [r for r in records if r.success]
    return {
        "ttft": [r.ttft_s * 1000.0 for r in done if r.ttft_s is not None],
        "tpot": [t * 1000.0 for t in (r.tpot_s for r in done) if t is not None],
        "itl": [gap * 1000.0 for r in done for gap in r.itl_s],
        "e2el": [r.e2e_s * 1000.0 for r in done if r.e2e_s is not None],
    }


def plot_latency_cdfs(records_by_label: Mapping[str, Sequence[RequestRecord]], path: str | Path) -> Path:
    """One figure, a panel per latency metric, one empirical CDF line per run; returns the path."""
    figure = _figure(2, 2)
    samples = {label: latency_samples_ms(records) for label, records in records_by_label.items()}
    for axes, (metric, title) in zip(figure.axes, _LATENCIES):
        for label, by_metric in samples.items():
            values = sorted(by_metric[metric])
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                axes.step(values, fractions, where="post", label=f"{label} (n={len(values)})")
        axes.set_title(title)
        axes.set_xlabel("ms")
        axes.set_ylabel("fraction of samples")
        axes.set_ylim(0.0, 1.02)
        axes.grid(True, alpha=0.3)
        if axes.has_data():
            axes.legend(fontsize="small")
    return _save(figure, path)


def plot_throughput(summaries: Mapping[str, Summary], path: str | Path) -> Path:
    """Bars per run: request throughput, output token throughput, and goodput where SLOs were set."""
    panels: list[tuple[str, str, list[float]]] = [
        ("Request throughput", "req/s", [s.request_throughput_rps for s in summaries.values()]),
        ("Output token throughput", "tok/s", [s.output_throughput_tps for s in summaries.values()]),
    ]
    slos = next((s.slos_ms for s in summaries.values() if s.slos_ms), None)
    if slos:
        condition = ", ".join(f"{name} <= {limit:g} ms" for name, limit in slos.items())
        goodputs = [s.goodput_rps or 0.0 for s in summaries.values()]
        panels.append((f"Goodput ({condition})", "req/s", goodputs))
    figure = _figure(1, len(panels))
    labels = list(summaries)
    colours = [f"C{i}" for i in range(len(labels))]
    for axes, (title, unit, values) in zip(figure.axes, panels):
        bars = axes.bar(labels, values, color=colours)
        axes.bar_label(bars, fmt="%.2f", fontsize="small")
        axes.set_title(title, fontsize="medium")
        axes.set_ylabel(unit)
        axes.tick_params(axis="x", labelrotation=20)
    return _save(figure, path)


def _figure(num_rows: int, num_cols: int) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.0 * num_cols, 3.8 * num_rows), layout="constrained")
    FigureCanvasAgg(figure)
    figure.subplots(num_rows, num_cols, squeeze=False)
    return figure


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    return path
