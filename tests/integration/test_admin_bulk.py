"""Bulk operator changes: requeue and cancel in batches, their --json results, interruption
part way, races with relays claiming the same rows, prune's clamp line, and the progress bar
(shown on a terminal only)."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.orm import Session

from outbox import Email, Outbox
from outbox.schema import attempts, messages
from relay import store
from relay.admin import CHANGE_BATCH
from relay.cli import main
from relay.db import make_engine
from tests.support.relays import RELAY, clean_env
from tests.support.waiting import wait_for

OB = Outbox()
N = 3000  # six batches of CHANGE_BATCH


def make_messages(engine: sa.Engine, n: int, **values: Any) -> list[int]:
    """``n`` messages cloned from one real enqueue (fast), with ``values`` set on all."""
    with Session(engine) as session:
        first = OB.enqueue(
            session,
            Email(sender="shop@example.com", to=["c@example.com"], subject="S", text="t"),
            key="bulk:0",
        ).id
        session.commit()
    with engine.begin() as conn:
        row = dict(conn.execute(sa.select(messages).where(messages.c.id == first)).one()._mapping)
        row.pop("id")
        if n > 1:
            conn.execute(
                sa.insert(messages), [{**row, "idempotency_key": f"bulk:{i}"} for i in range(1, n)]
            )
        if values:
            conn.execute(sa.update(messages).values(**values))
        return list(conn.execute(sa.select(messages.c.id).order_by(messages.c.id)).scalars())


def statuses(engine: sa.Engine) -> Counter[str]:
    with engine.connect() as conn:
        return Counter(conn.execute(sa.select(messages.c.status)).scalars())


def operator_attempts(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(sa.select(attempts).where(attempts.c.relay_id.like("operator%"))).all()
        )


def cli(url: str, *args: str) -> Any:
    return CliRunner().invoke(main, list(args), env={"OUTBOX_DATABASE_URL": url})


@contextmanager
def counting() -> Iterator[Counter[str]]:
    """Every engine's statements by kind, and its commits, while the block runs."""
    seen: Counter[str] = Counter()

    def on_execute(conn, cursor, statement, parameters, context, executemany) -> None:
        words = statement.split()
        kind = words[0].upper()
        if kind == "SELECT" and "FOR UPDATE" in statement:
            kind = "SELECT FOR UPDATE"
        target = next((w.split(".")[0] for w in words if w.startswith("outbox_")), "")
        seen[f"{kind} {target}".strip()] += 1

    def on_commit(conn) -> None:
        seen["COMMIT"] += 1

    sa.event.listen(sa.Engine, "before_cursor_execute", on_execute)
    sa.event.listen(sa.Engine, "commit", on_commit)
    try:
        yield seen
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", on_execute)
        sa.event.remove(sa.Engine, "commit", on_commit)


def test_a_bulk_requeue_changes_one_batch_per_transaction(server_backend):
    engine, url = server_backend.engine, server_backend.url
    ids = make_messages(engine, N, status="failed", attempt_count=5, last_error_code="Throttling")
    with counting() as seen:
        done = cli(
            url, "requeue", "--status", "failed", "--yes", "--reason", "quota raised", "--json"
        )
    assert done.exit_code == 0, done.output
    batches = N // CHANGE_BATCH
    assert seen["UPDATE outbox_messages"] == batches  # set-based: not one UPDATE per row
    assert seen["COMMIT"] == batches  # one transaction per batch, not one giant one
    assert seen["INSERT outbox_attempts"] == batches  # the attempt rows go with their batch
    assert seen["INSERT outbox_operator_actions"] == batches  # and so do the log rows
    # each batch is locked first, so the log's previous status is the one replaced; MariaDB,
    # without UPDATE ... RETURNING, locks it once more in the requeue itself
    locks = 2 if server_backend.name == "mysql" else 1
    assert seen["SELECT FOR UPDATE outbox_messages"] == locks * batches
    report = json.loads(done.stdout)
    assert report == {
        "command": "requeue",
        "matched": N,
        "requeued": N,
        "moved_meanwhile": 0,
        "requeued_ids": ids,
        "moved_meanwhile_ids": [],
    }
    assert statuses(engine) == {"pending": N}
    with engine.connect() as conn:
        assert set(conn.execute(sa.select(messages.c.attempt_count)).scalars()) == {0}
    history = operator_attempts(engine)
    assert sorted(a.message_id for a in history) == ids
    assert {(a.outcome, a.error_message) for a in history} == {("requeued", "quota raised")}


def test_a_bulk_cancel_changes_one_batch_per_transaction_and_reports_json(server_backend):
    engine, url = server_backend.engine, server_backend.url
    ids = make_messages(engine, 1200)
    with counting() as seen:
        done = cli(url, "cancel", "--key", "bulk:*", "--yes", "--json")
    assert done.exit_code == 0, done.output
    assert seen["UPDATE outbox_messages"] == seen["COMMIT"] == 3
    report = json.loads(done.stdout)
    assert (report["command"], report["matched"], report["cancelled"]) == ("cancel", 1200, 1200)
    assert report["cancelled_ids"] == ids
    assert statuses(engine) == {"cancelled": 1200}
    assert {a.outcome for a in operator_attempts(engine)} == {"cancelled"}


def test_requeue_and_cancel_of_given_ids_say_which_moved_meanwhile(backend):
    engine, url = backend.engine, backend.url
    ids = make_messages(engine, 3, status="unknown_outcome")
    done = cli(url, "requeue", str(ids[2]), str(ids[0]), "--json")
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert report["requeued_ids"] == [ids[0], ids[2]]
    assert (report["matched"], report["moved_meanwhile"]) == (2, 0)
    text = cli(url, "cancel", str(ids[0]))
    assert text.exit_code == 0, text.output
    assert text.stdout == "cancelled 1 message(s)\n"


class Interrupt:
    """Ctrl-C arriving while the ``nth`` UPDATE of outbox_messages is sent: what a SIGINT
    does to the command at that moment, at a moment a test can choose."""

    def __init__(self, nth: int, statement: str = "UPDATE outbox_messages") -> None:
        self.nth, self.seen, self.statement = nth, 0, statement

    def __call__(self, conn, cursor, statement, parameters, context, executemany) -> None:
        if statement.startswith(self.statement):
            self.seen += 1
            if self.seen == self.nth:
                raise KeyboardInterrupt


def test_a_bulk_requeue_interrupted_half_way_leaves_whole_batches_and_finishes_when_rerun(
    backend,
):
    engine, url = backend.engine, backend.url
    ids = make_messages(engine, N, status="failed")
    interrupt = Interrupt(3)
    sa.event.listen(sa.Engine, "before_cursor_execute", interrupt)
    try:
        stopped = cli(url, "requeue", "--status", "failed", "--yes", "--reason", "r")
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", interrupt)
    assert stopped.exit_code == 1, stopped.output
    two = 2 * CHANGE_BATCH
    assert stopped.stderr.strip() == (
        f"Error: interrupted: requeued {two} of {N} message(s) (every id up to {ids[two - 1]}), "
        "the others are unchanged; requeue them by running the command again"
    )
    # the two committed batches are whole, each with its attempt rows; the third rolled back
    assert statuses(engine) == {"pending": two, "failed": N - two}
    assert sorted(a.message_id for a in operator_attempts(engine)) == ids[:two]
    again = cli(url, "requeue", "--status", "failed", "--yes", "--reason", "r")
    assert again.exit_code == 0, again.output
    assert again.stdout == f"requeued {N - two} message(s)\n"
    assert statuses(engine) == {"pending": N}
    assert sorted(a.message_id for a in operator_attempts(engine)) == ids  # one each


def test_an_interrupted_requeue_of_given_ids_names_the_ids_to_give_again(backend):
    """Rerunning with the same ids would be refused (the done ones are pending now), so the
    line names where to resume and ``--json`` lists the unchanged ids; given again, they
    finish it."""
    engine, url = backend.engine, backend.url
    ids = make_messages(engine, 2 * CHANGE_BATCH + 10, status="unknown_outcome")
    interrupt = Interrupt(2)
    sa.event.listen(sa.Engine, "before_cursor_execute", interrupt)
    try:
        stopped = cli(url, "requeue", *map(str, reversed(ids)), "--json")
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", interrupt)
    assert stopped.exit_code == 1, stopped.output
    last = ids[CHANGE_BATCH - 1]
    assert stopped.stderr.strip() == (
        f"Error: interrupted: requeued {CHANGE_BATCH} of {len(ids)} message(s) (every id up "
        f"to {last}), the others are unchanged; requeue them by running the command again "
        f"with the given ids after {last}"
    )
    report = json.loads(stopped.stdout)
    assert report["interrupted"] == "interrupted"
    assert report["requeued_ids"] == ids[:CHANGE_BATCH]
    assert report["unchanged_ids"] == ids[CHANGE_BATCH:]
    refused = cli(url, "requeue", *map(str, ids))  # the same ids: refused, in one short line
    assert refused.exit_code == 1
    assert refused.stderr.strip() == (
        f"Error: cannot requeue {', '.join(f'{i} (pending)' for i in ids[:10])} and "
        f"{CHANGE_BATCH - 10} more: only unknown_outcome or failed messages"
    )
    again = cli(url, "requeue", *map(str, report["unchanged_ids"]))
    assert again.exit_code == 0, again.output
    assert statuses(engine) == {"pending": len(ids)}
    assert sorted(a.message_id for a in operator_attempts(engine)) == ids  # one each


def test_a_requeue_interrupted_as_a_batch_commits_counts_that_batch(backend, monkeypatch):
    """Ctrl-C arriving just as a batch's COMMIT completes (a moment only a hook on the
    dialect's commit can choose): the batch landed, and the line says so, from its attempt
    rows, instead of calling it unchanged."""
    engine, url = backend.engine, backend.url
    ids = make_messages(engine, 2 * CHANGE_BATCH + 10, status="failed")
    dialect = type(engine.dialect)
    commit, commits = dialect.do_commit, Counter[str]()

    def commit_then_interrupt(self, dbapi_connection) -> None:
        commit(self, dbapi_connection)
        commits["seen"] += 1
        if commits["seen"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(dialect, "do_commit", commit_then_interrupt)
    stopped = cli(url, "requeue", "--status", "failed", "--yes", "--json")
    monkeypatch.undo()
    assert stopped.exit_code == 1, stopped.output
    two = 2 * CHANGE_BATCH
    assert stopped.stderr.strip().startswith(
        f"Error: interrupted: requeued {two} of {len(ids)} message(s) (every id up to "
        f"{ids[two - 1]}), the others are unchanged"
    )
    report = json.loads(stopped.stdout)
    assert report["requeued_ids"] == ids[:two]
    assert report["unchanged_ids"] == ids[two:]
    assert statuses(engine) == {"pending": two, "failed": len(ids) - two}


def test_a_cancel_takes_more_ids_than_one_statement_holds_parameters(server_backend):
    """More ids than PostgreSQL's 65,535 parameters a statement (pasted from ``list
    --json``): all are checked and cancelled, instead of a database error."""
    engine, url = server_backend.engine, server_backend.url
    ids = make_messages(engine, 66_000)
    done = cli(url, "cancel", *map(str, ids))
    assert done.exit_code == 0, done.output
    assert done.stdout == f"cancelled {len(ids)} message(s)\n"
    assert statuses(engine) == {"cancelled": len(ids)}


def lock_waiters(engine: sa.Engine) -> int:
    """How many sessions wait for a row lock right now (on MariaDB: run the cancel's locking
    SELECT, which cannot finish while the claim holds its rows)."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            sql = (
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
        else:
            sql = (
                "SELECT count(*) FROM information_schema.processlist "
                "WHERE info LIKE 'SELECT outbox\\_messages.id%FOR UPDATE'"
            )
        return int(conn.execute(sa.text(sql)).scalar_one())


def test_a_cancel_racing_a_relay_claim_leaves_the_claimed_rows_to_the_relay(server_backend):
    """The relay's claim commits while the cancel waits on its rows: the cancel, which had
    counted them as pending, finds them processing and leaves them (and records nothing)."""
    engine, url = server_backend.engine, server_backend.url
    ids = make_messages(engine, 10, next_attempt_at=datetime.now(UTC) - timedelta(minutes=1))
    relay_engine = make_engine(url)
    try:
        with relay_engine.connect() as relay:
            claim = relay.begin()
            claims, _ = store.claim_batch(
                relay, relay_id="relay-a", limit=4, now=datetime.now(UTC), lease_seconds=60
            )
            claimed = sorted(c.id for c in claims)
            assert len(claimed) == 4
            operator = subprocess.Popen(
                [RELAY, "cancel", "--key", "bulk:*", "--yes", "--json"],
                env=clean_env(OUTBOX_DATABASE_URL=url),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                wait_for(
                    lambda: lock_waiters(engine) > 0 or operator.poll() is not None,
                    timeout=30,
                    interval=0.05,
                    what="the cancel to wait on the claim",
                )
                assert operator.poll() is None, operator.communicate()
                claim.commit()
                out, err = operator.communicate(timeout=60)
            finally:
                operator.kill()
                operator.wait()
    finally:
        relay_engine.dispose()
    assert operator.returncode == 0, err
    report = json.loads(out)
    assert report["matched"] == 10  # it counted them before the claim committed
    assert report["moved_meanwhile_ids"] == claimed
    assert report["cancelled_ids"] == [i for i in ids if i not in claimed]
    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(sa.select(messages)).all()}
    assert {rows[i].status for i in claimed} == {"processing"}
    assert {rows[i].claimed_by for i in claimed} == {"relay-a"}
    assert sorted(a.message_id for a in operator_attempts(engine)) == report["cancelled_ids"]


def test_a_relay_claim_racing_a_requeue_neither_waits_nor_claims_until_it_commits(
    server_backend,
):
    """Rows a requeue batch has changed but not committed are invisible to a relay's claim
    (PostgreSQL reads the committed row; MariaDB skips the locked one): the claim returns at
    once, without them; once the batch commits, one claim takes each row once."""
    engine = server_backend.engine
    ids = make_messages(engine, 5, status="failed", attempt_count=3)
    relay_engine = make_engine(server_backend.url)
    try:
        with engine.connect() as requeue, relay_engine.connect() as relay:
            batch = requeue.begin()
            assert store.requeue_many(requeue, ids=ids, now=datetime.now(UTC)) == ids
            with relay.begin():
                if relay.dialect.name == "postgresql":
                    relay.exec_driver_sql("SET LOCAL lock_timeout = '5s'")
                else:
                    relay.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = 5")
                started = time.monotonic()
                claims, _ = store.claim_batch(
                    relay, relay_id="r", limit=10, now=datetime.now(UTC), lease_seconds=60
                )
                assert claims == []
                assert time.monotonic() - started < 4  # did not wait out the lock timeout
            batch.commit()
            with relay.begin():
                claims, _ = store.claim_batch(
                    relay, relay_id="r", limit=10, now=datetime.now(UTC), lease_seconds=60
                )
            assert sorted(c.id for c in claims) == ids
            assert {c.attempt_count for c in claims} == {0}
    finally:
        relay_engine.dispose()


def test_an_interrupted_prune_still_reports_json(backend):
    """Stopped in its second batch, prune --json still prints how many it deleted (the first
    batch, committed), with the one-line error and exit 1."""
    engine, url = backend.engine, backend.url
    old = datetime.now(UTC) - timedelta(days=60)
    make_messages(engine, 25, status="sent", created_at=old, updated_at=old)
    interrupt = Interrupt(2, "DELETE FROM outbox_messages")
    sa.event.listen(sa.Engine, "before_cursor_execute", interrupt)
    try:
        stopped = cli(url, "prune", "--older-than", "30d", "--batch-size", "10", "--json")
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", interrupt)
    assert stopped.exit_code == 1, stopped.output
    assert stopped.stderr.strip() == (
        "Error: interrupted: deleted 10 message(s) and dropped the bodies of 0 before it "
        "stopped; run the command again to do the rest"
    )
    report = json.loads(stopped.stdout)
    assert (report["interrupted"], report["deleted"]) == ("interrupted", 10)
    assert statuses(engine) == {"sent": 15}


def test_prune_says_when_the_dedup_window_clamps_and_reports_json(backend):
    engine, url = backend.engine, backend.url
    old = datetime.now(UTC) - timedelta(days=40)
    make_messages(engine, 3, status="sent", created_at=old, updated_at=old)
    dry = cli(url, "prune", "--older-than", "1s", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    assert dry.stderr == (
        "--older-than 1 second is inside the dedup window (30 days): "
        "pruning messages older than 30 days instead\n"
    )
    report = json.loads(dry.stdout)
    assert {k: v for k, v in report.items() if not k.endswith("cutoff")} == {
        "command": "prune",
        "dry_run": True,
        "would_delete": 3,
        "would_delete_events": 0,
        "would_delete_relays": 0,
        "would_drop_bodies": 0,  # the three it deletes are not counted again
        "keep_bodies_seconds": 7 * 86400.0,
        "keep_failed_bodies_seconds": 30 * 86400.0,
        "include_unknown_outcome": False,
        "older_than_seconds": 1.0,
        "dedup_window_seconds": 30 * 86400.0,
        "unmatched_events_older_than_seconds": 3 * 86400.0,
        "stopped_relays_older_than_seconds": 7 * 86400.0,
        "clamped_to_dedup_window": True,
    }
    cutoff = datetime.fromisoformat(report["cutoff"])
    assert abs(cutoff - (datetime.now(UTC) - timedelta(days=30))) < timedelta(minutes=5)
    done = cli(url, "prune", "--older-than", "35d", "--batch-size", "2", "--json")
    assert done.exit_code == 0, done.output
    assert done.stderr == ""  # 35 days is outside the window: nothing clamped
    report = json.loads(done.stdout)
    assert (report["deleted"], report["clamped_to_dedup_window"]) == (3, False)
    assert statuses(engine) == {}


def in_terminal(*args: str, url: str) -> str:
    """Run the CLI with a pseudo-terminal as stdout and stderr; everything it wrote."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [RELAY, *args],
        env=clean_env(OUTBOX_DATABASE_URL=url, COLUMNS="100"),
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    chunks: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(leader, chunks))
    reader.start()
    assert process.wait(timeout=120) == 0, b"".join(chunks).decode()
    reader.join(timeout=30)
    os.close(leader)
    return b"".join(chunks).decode()


def _drain(fd: int, chunks: list[bytes]) -> None:
    while True:
        ready, _, _ = select.select([fd], [], [], 30)
        if not ready:
            return
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the terminal's last writer has exited
            return
        if not chunk:
            return
        chunks.append(chunk)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_bulk_changes_show_progress_on_a_terminal_only(backend, tmp_path):
    engine, url = backend.engine, backend.url
    make_messages(engine, 1200, status="failed")
    shown = in_terminal("requeue", "--status", "failed", "--yes", url=url)
    assert "requeue 1200 message(s)" in shown
    assert "100%" in shown
    assert shown.rstrip().endswith("requeued 1200 message(s)")
    old = datetime.now(UTC) - timedelta(days=40)
    with engine.begin() as conn:
        conn.execute(sa.update(messages).values(status="sent", created_at=old, updated_at=old))
    pruned = in_terminal("prune", "--older-than", "31d", "--batch-size", "500", url=url)
    assert "prune 1200 message(s)" in pruned
    assert "100%" in pruned

    make_messages(engine, 600, status="failed")  # piped: the result only, not a bar
    piped = subprocess.run(
        [RELAY, "requeue", "--status", "failed", "--yes"],
        env=clean_env(OUTBOX_DATABASE_URL=url),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert piped.returncode == 0, piped.stderr
    assert (piped.stdout, piped.stderr) == ("requeued 600 message(s)\n", "")
