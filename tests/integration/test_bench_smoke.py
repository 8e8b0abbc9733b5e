"""Smoke test of the benchmark runner (``python -m bench``): it completes at a tiny scale,
prints its table and writes JSON with a ratio per benchmark, for the first five benchmarks,
with the drain's database cost and CPU rows and, on PostgreSQL, the peer pgqueuer's; and the
fairness benchmark at its quick size, which must show the small keys served before the big
backlog. No speed is asserted here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

REPO = Path(__file__).resolve().parents[2]


def _bench_url(backend_name, request, tmp_path):
    if backend_name == "sqlite":
        return f"sqlite:///{tmp_path}/bench.db"
    # a database of its own next to the test database: the benchmark drops its tables
    server = sa.make_url(request.getfixturevalue("_backends")[backend_name].url)
    return server.set(database=f"{server.database}_bench").render_as_string(hide_password=False)


def _run_bench(*args):
    return subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("backend_name", ["sqlite", "postgresql"])
def test_bench_runs_and_reports_a_ratio_per_benchmark(backend_name, request, tmp_path):
    url = _bench_url(backend_name, request, tmp_path)
    out = tmp_path / "bench.json"
    proc = _run_bench(
        "--quick", "--scale", "0.02", "--only", "drain,rate,enqueue,latency,backlog",
        "--database-url", url, "--json", str(out),
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


def test_drain_email_bench_sets_the_relay_against_pgqueuer_with_a_real_email(request, tmp_path):
    """PostgreSQL: the relay's and pgqueuer's drain with a real email in each row, statements,
    WAL (with where it goes) and CPU per message; elsewhere the case has nothing to report."""
    out = tmp_path / "bench.json"
    proc = _run_bench(
        "--quick", "--only", "drain-email", "--json", str(out),
        "--database-url", _bench_url("postgresql", request, tmp_path),
        "--database-url", _bench_url("sqlite", request, tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["failures"] == []
    rows = {r["benchmark"]: r for r in report["results"]}
    assert {r["database"] for r in rows.values()} == {"postgresql"}
    assert set(rows) == {
        "drain, email vs pgqueuer",
        "statements/msg, email vs pgqueuer",
        "WAL bytes/msg, email vs pgqueuer",
        "CPU s/1k msgs, email vs pgqueuer",
    }
    for row in rows.values():
        assert row["value"] > 0, row
        assert row["baseline"] > 0, row
    details = rows["WAL bytes/msg, email vs pgqueuer"]["details"]
    assert details["payload_bytes"] > 5000  # a real email, not the drain's short one
    where = details["wal_by_record_per_msg"]
    assert any(k.startswith("outbox_messages Heap/UPDATE") for k in where["relay"])
    assert any(k.startswith("pgqueuer") for k in where["pgqueuer"])


@pytest.mark.parametrize("backend_name", ["sqlite", "postgresql", "mysql"])
def test_fairness_bench_sends_the_small_keys_before_the_big_backlog(
    backend_name, request, tmp_path
):
    """2,000 messages of key A, then 10 x 10 of keys B..K, at 1,000 recipients/s, by one relay
    and by three: with keys every B..K message is sent before 90% of A's are; without keys
    (the same run's control) they wait behind most of A's."""
    out = tmp_path / "bench.json"
    url = _bench_url(backend_name, request, tmp_path)
    proc = _run_bench("--quick", "--only", "fairness", "--database-url", url, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["failures"] == []
    results = {r["benchmark"]: r for r in report["results"]}
    for label in ("1 relay", "3 relays"):
        assert {
            f"fair B..K max latency, {label}",
            f"fair B..K p99 latency, {label}",
            f"fair throughput, {label}",
        } <= results.keys()
        runs = results[f"fair B..K max latency, {label}"]["details"]
        keyed, plain = runs["keys"], runs["no_keys"]
        assert set(keyed["per_key"]) == set("BCDEFGHIJK")
        assert keyed["A_unclaimed_when_B..K_enqueued"] > 400, keyed  # A's backlog was there
        assert keyed["A_sent_by_last_B..K"] < 0.9, keyed
        assert keyed["B..K"]["max"] < keyed["A"]["max"] / 2, keyed
        assert plain["A_sent_by_last_B..K"] > 0.75, plain
        assert results[f"fair throughput, {label}"]["value"] > 0


@pytest.mark.parametrize("backend_name", ["sqlite", "postgresql"])
def test_soak_bench_drops_bodies_and_prunes_rows_while_it_runs(backend_name, request, tmp_path):
    """15 s of the soak (``--quick --scale 0.25``): one relay drains, prunes run every 5 s
    with bodies kept 1 s and rows 5 s, so within the run bodies are dropped and rows pruned;
    the samples are in the report and the relay and prunes are gone when it ends."""
    out = tmp_path / "bench.json"
    url = _bench_url(backend_name, request, tmp_path)
    proc = _run_bench(
        "--quick", "--scale", "0.25", "--only", "soak", "--database-url", url, "--json", str(out)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["failures"] == []
    results = {r["benchmark"]: r for r in report["results"]}
    assert {
        "soak outbox bytes, end vs steady",
        "soak rows held, steady max",
        "soak bodies held, steady max",
        "soak queued, steady max",
        "soak bodies dropped",
        "soak rows pruned",
    } <= results.keys()
    garbage = "soak dead tuples, max" if backend_name == "postgresql" else "soak free pages, max"
    assert garbage in results
    details = results["soak outbox bytes, end vs steady"]["details"]
    samples, prunes = details["samples"], details["prunes"]
    assert len(samples) >= 4  # every 1.5 s nominally; fewer when the machine is loaded
    assert all(s["bytes"] > 0 for s in samples)
    assert "outbox_messages" in samples[-1]["tables"]
    assert prunes  # one or more: the command takes seconds to start on a busy machine
    assert results["soak bodies dropped"]["value"] > 0
    assert results["soak rows pruned"]["value"] > 0
    # what the prunes dropped shows in the samples too: fewer bodies than rows held
    assert min(s["bodies"] - s["rows"] for s in samples) < 0
    running = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [args for args in running.splitlines() if "outbox-relay" in args and url in args]


@pytest.mark.parametrize("backend_name", ["sqlite", "postgresql"])
def test_retention_bench_measures_less_storage_once_bodies_are_dropped(
    backend_name, request, tmp_path
):
    """1,000 sent messages with bodies, their bodies dropped by ``outbox-relay prune
    --keep-bodies 0``: the messages table holds fewer bytes per message after the drop
    (compacted and in place) than before it, and some. No size target is asserted."""
    out = tmp_path / "bench.json"
    url = _bench_url(backend_name, request, tmp_path)
    proc = _run_bench(
        "--quick", "--scale", "0.05", "--only", "retention", "--database-url", url,
        "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["failures"] == []
    results = {r["benchmark"]: r for r in report["results"]}
    compacted = results["retained B/msg, compacted"]
    assert compacted["details"]["messages"] == 1000
    for name in ("retained B/msg, compacted", "retained B/msg, in place"):
        assert 0 < results[name]["value"] < results[name]["baseline"], results[name]
    assert results["body drop"]["details"]["bodies"] == 1000
    stages = compacted["details"]["bytes_per_message"]
    assert stages["before"]["outbox_messages"]["indexes"]  # the per-index breakdown
    assert stages["compacted"]["outbox_attempts"]["total"] > 0


@pytest.mark.parametrize("backend_name", ["sqlite", "postgresql"])
def test_console_bench_times_every_query_of_the_messages_page(backend_name, request, tmp_path):
    """1,000 messages of the mix, one operator logged in, each query of the messages page and
    its bare SELECT timed: every page answered 200, the unfiltered and the deep page showed a
    full page of rows, and every time is above zero. No speed is asserted here."""
    out = tmp_path / "bench.json"
    url = _bench_url(backend_name, request, tmp_path)
    proc = _run_bench(
        "--quick", "--scale", "0.05", "--only", "console", "--database-url", url,
        "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["failures"] == []
    results = {r["benchmark"]: r for r in report["results"]}
    headline = results["console /messages p95, worst of 9"]
    assert headline["target"] == "< 200 ms"
    assert headline["ratio"] == pytest.approx(headline["value"] / 200)
    details = headline["details"]
    assert details["messages"] == 1000
    assert details["worst"] in details["queries"]
    queries = details["queries"]
    assert len(queries) == 9
    for name, q in queries.items():
        assert q["status"] == 200, name
        assert q["page_ms"]["p95"] > 0, (name, q)
        assert q["select_ms"]["p95"] > 0, (name, q)
        assert q["rows_shown"] == min(q["rows_selected"], 50), (name, q)
        assert q["plan"], name
        row = results[f"console p95, {name}"]
        assert row["value"] == q["page_ms"]["p95"]
        assert row["baseline"] == q["select_ms"]["p95"]
    for name in ("no filter", "deep page"):
        assert queries[name]["rows_shown"] == 50, queries[name]
    assert 0 < queries["status=failed"]["matching"] < 1000
    assert headline["value"] == max(q["page_ms"]["p95"] for q in queries.values())
