"""Command line: run the chosen benchmarks on each database, print a table, write JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.cases import CASES as CORE_CASES
from bench.cases import Result, Sizes, drain_email
from bench.console import console
from bench.db import prepare
from bench.retention import retention
from bench.soak import soak

__all__ = ["CASES", "format_table", "machine", "main"]

# The benchmarks by name; the storage ones live in modules of their own.
CASES = {
    **CORE_CASES, "soak": soak, "retention": retention, "console": console,
    "drain-email": drain_email,
}  # fmt: skip


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "sqlalchemy": sa.__version__,
    }


def _fmt(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value < 1:  # per-message costs: statements, CPU seconds
        return f"{value:.3g}"
    return f"{value:.2f}"


def format_table(results: list[Result]) -> str:
    head = ("benchmark", "database", "value", "baseline", "ratio", "target", "met?")
    rows = [
        (
            r.benchmark,
            r.database,
            f"{_fmt(r.value)} {r.unit}",
            f"{_fmt(r.baseline)} {r.unit}",
            f"{r.ratio:.2f}",
            r.target,
            "-" if r.met is None else ("yes" if r.met else "NO"),
        )
        for r in results
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]
    lines = [
        " | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True))
        for row in (head, *rows)
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _label(url: str) -> str:
    return sa.make_url(url).get_backend_name()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--database-url",
        action="append",
        default=[],
        help="database to benchmark (repeatable); default: a SQLite temp file. The benchmark "
        "drops and recreates the outbox tables there.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--big", action="store_true", help="backlog: 1M due + 5M finished rows")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every size")
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated subset of {','.join(CASES)} (default: all but soak, retention, "
        "console and drain-email, which take long)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)

    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CORE_CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(CASES)}")
    sizes = Sizes.make(quick=args.quick, big=args.big, scale=args.scale)

    tmp = None
    urls = list(args.database_url)
    if not urls:
        tmp = tempfile.TemporaryDirectory(prefix="outbox-bench-")
        urls = [f"sqlite:///{tmp.name}/bench.db"]
    results: list[Result] = []
    failures: list[dict[str, str]] = []
    try:
        for url in urls:
            engine = prepare(url)
            try:
                for name in names:
                    began = time.perf_counter()
                    print(f"# {name} on {_label(url)} ...", file=sys.stderr, flush=True)
                    try:
                        results.extend(CASES[name](engine, sizes, _label(url)))
                    except Exception as exc:
                        traceback.print_exc()
                        failures.append(
                            {"benchmark": name, "database": _label(url), "error": repr(exc)}
                        )
                    print(f"#   {time.perf_counter() - began:.1f}s", file=sys.stderr, flush=True)
            finally:
                engine.dispose()
    finally:
        if tmp is not None:
            tmp.cleanup()

    print(format_table(results))
    for failure in failures:
        print(f"FAILED {failure['benchmark']} on {failure['database']}: {failure['error']}")
    if args.json is not None:
        report = {
            "machine": machine(),
            "sizes": dataclasses.asdict(sizes),
            "results": [dataclasses.asdict(r) for r in results],
            "failures": failures,
        }
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 1 if failures else 0
