"""The device check's record: one JSON line per stage, and the table scripts/gpu_check.sh prints last.

    python -m experiments.gpu_check_report record JSONL --stage S --status ok --rc 0 --seconds 12 \\
        --limit 60 [--figures FILE] [--note TEXT]
    python -m experiments.gpu_check_report table JSONL

A line holds the stage, its status (`ok`, `failed`, `timeout`, `skipped`), exit code, seconds, time
limit, the summary and figures its module wrote (`--figures`, see experiments/gpu_common.py; for a stage
without them, the last line of its output, `--log`), and a note (why it was skipped, or failed). Torch-free: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

STATUSES = ("ok", "failed", "timeout", "skipped")


def record(args: argparse.Namespace) -> None:
    line: dict[str, Any] = {
        "stage": args.stage,
        "status": args.status,
        "rc": args.rc,
        "seconds": args.seconds,
        "limit_s": args.limit,
        "summary": "",
        "figures": None,
        "note": args.note,
    }
    figures = Path(args.figures) if args.figures else None
    log = Path(args.log) if args.log else None
    if log is not None and log.exists():  # a stage without figures (a shell one): its last line says enough
        lines = [line.strip() for line in log.read_text(encoding="utf-8", errors="replace").splitlines()]
        line["summary"] = next((text for text in reversed(lines) if text), "")[:120]
    if figures is not None and figures.exists():
        try:
            written = json.loads(figures.read_text(encoding="utf-8"))
            line["summary"], line["figures"] = written.get("summary", ""), written.get("figures")
        except ValueError as exc:  # a stage cut off while writing: say so, keep the line
            line["note"] = f"{args.note} (figures unreadable: {exc})".strip()
    with open(args.jsonl, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def read(path: str | Path) -> list[dict[str, Any]]:
    """The stages' lines, in the order they ran."""
    text = Path(path).read_text(encoding="utf-8") if Path(path).exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def table(lines: list[dict[str, Any]]) -> str:
    rows = [["stage", "status", "seconds", "limit s", "figures / note"]]
    for line in lines:
        what = line["summary"] or line["note"] or ""
        if line["status"] == "skipped":
            what = line["note"] or line["summary"]
        elif line["status"] != "ok" and line["note"]:
            what = f"{line['summary']} ({line['note']})" if line["summary"] else line["note"]
        rows.append([line["stage"], line["status"], f"{line['seconds']:.0f}", f"{line['limit_s']:.0f}", what])
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    out = ["", "== gpu_check summary"]
    for row in rows:
        out.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    total = sum(line["seconds"] for line in lines)
    bad = [line["stage"] for line in lines if line["status"] in ("failed", "timeout")]
    out.append(
        f"{len(lines)} stages in {total:.0f} s; "
        + (f"not ok: {' '.join(bad)}" if bad else "all ran or were skipped")
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="append one stage's line")
    rec.add_argument("jsonl")
    rec.add_argument("--stage", required=True)
    rec.add_argument("--status", required=True, choices=STATUSES)
    rec.add_argument("--rc", type=int, default=0)
    rec.add_argument("--seconds", type=float, default=0.0)
    rec.add_argument("--limit", type=float, default=0.0)
    rec.add_argument("--figures", default=None)
    rec.add_argument("--note", default="")
    rec.add_argument(
        "--log", default=None, help="the stage's output: its last line is the summary without figures"
    )
    tab = commands.add_parser("table", help="print the summary table")
    tab.add_argument("jsonl")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args)
    else:
        print(table(read(args.jsonl)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
