"""Smoke test of the benchmark runner (``python -m bench``): it completes at a tiny scale,
prints its table and writes JSON with a ratio per benchmark, for all five benchmarks, with
the drain's database cost and CPU rows and, on PostgreSQL, the peer pgqueuer's. No speed is
asserted here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("backend_name", ["sqlite", "postgresql"])
def test_bench_runs_and_reports_a_ratio_per_benchmark(backend_name, request, tmp_path):
    if backend_name == "sqlite":
        url = f"sqlite:///{tmp_path}/bench.db"
    else:
        # a database of its own next to the test database: the benchmark drops its tables
        server = sa.make_url(request.getfixturevalue("_backends")["postgresql"].url)
        url = server.set(database=f"{server.database}_bench").render_as_string(hide_password=False)
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "bench", "--quick", "--scale", "0.02",
            "--database-url", url, "--json", str(out),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = proc.stdout.splitlines()[0]
    for column in ("benchmark", "database", "value", "baseline", "ratio", "target", "met?"):
        assert column in header
    report = json.loads(out.read_text())
    assert report["failures"] == []
    assert report["machine"]["nproc"] >= 1
    benchmarks = {r["benchmark"] for r in report["results"]}
    assert {
        "drain",
        "drain x2 procs",
        "rate 500/s @50ms",
        "enqueue 1 email",
        "enqueue_many 10 emails",
        "enqueue_many 100 emails",
        "enqueue 10 emails, one call each",
        "backlog claim",
    } <= benchmarks
    assert any(name.startswith("latency p99") for name in benchmarks)
    peer = "pgqueuer" if backend_name == "postgresql" else "floor"
    cost_rows = {f"statements/msg vs {peer}", f"CPU s/1k msgs vs {peer}"}
    floors = {"enqueue 1 email, floor", "enqueue 10 emails, floor", "enqueue 100 emails, floor"}
    if backend_name == "postgresql":
        assert "claim, dead tuples" in benchmarks
        assert floors <= benchmarks  # what the database itself charges for the outbox rows
        cost_rows |= {"drain vs pgqueuer b50", "WAL bytes/msg vs pgqueuer"}
    else:
        assert not any("pgqueuer" in name or "WAL" in name for name in benchmarks)
        assert not floors & benchmarks
    assert cost_rows <= benchmarks
    for result in report["results"]:
        if result["benchmark"] in cost_rows:
            assert result["value"] > 0, result
    drain_costs = next(r for r in report["results"] if r["benchmark"].startswith("statements/"))
    for who in ("relay", "floor", *(["pgqueuer"] if backend_name == "postgresql" else [])):
        measured = drain_costs["details"][who]
        assert measured["statements_per_msg"] > 0
        assert measured["cpu_seconds_per_1000"] > 0
        assert (measured["wal_bytes_per_msg"] is not None) == (backend_name == "postgresql")
    for result in report["results"]:
        assert result["database"] == backend_name
        assert result["ratio"] > 0
        assert result["baseline"] > 0
        assert result["benchmark"] in proc.stdout
