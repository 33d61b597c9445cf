"""`BenchmarkResult`: one run, kept whole (arguments, summary, every request) and saved as JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.metrics import Summary
from bench.records import RequestRecord

RESULT_FORMAT = "splitserve-bench-serve/1"


@dataclass(frozen=True)
class BenchmarkResult:
    """A finished run: what it was asked (`arguments`), its `summary`, and every request's record.

    Records are in dataset order (for multi-turn: session by session, turn by turn).
    `to_json()` and `load()` round-trip it exactly, so later tools compare saved runs.
    """

    dataset: str
    started_at: str
    summary: Summary
    records: tuple[RequestRecord, ...]
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RESULT_FORMAT,
            "dataset": self.dataset,
            "started_at": self.started_at,
            "arguments": jsonable(self.arguments),
            "summary": self.summary.to_dict(),
            "requests": [r.to_dict() for r in self.records],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchmarkResult:
        if data.get("format") != RESULT_FORMAT:
            raise ValueError(
                f"not a bench serve result: format is {data.get('format')!r}, expected {RESULT_FORMAT!r}"
            )
        return cls(
            dataset=data["dataset"],
            started_at=data["started_at"],
            summary=Summary.from_dict(data["summary"]),
            records=tuple(RequestRecord.from_dict(r) for r in data["requests"]),
            arguments=dict(data.get("arguments", {})),
        )

    @classmethod
    def load(cls, path: str | Path) -> BenchmarkResult:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def jsonable(value: Any) -> Any:
    """`value` with infinite and NaN floats (JSON has none) as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value
