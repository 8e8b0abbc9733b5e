"""What an attack review found in outbox_0007 (the key's unique index) and the console's bulk
resolve, each a test that failed before its fix: racing enqueues of one key while the index
was built concurrently, a key index of the right name that guards nothing (kept, online or in
an offline script), a second schema's upgrade, a bulk resolve marking sent a message requeued
after its preview."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from sqlalchemy.orm import Session

from outbox import Outbox, migrations
from outbox.schema import messages
from relay.admin.change import resolve_one
from relay.console import Role
from tests.support.console import HIDDEN, OUTCOME, SAME, client, finished_job, login, users_file
from tests.support.db import fresh_database
from tests.support.factories import email, enqueue
from tests.support.migrating import old_row

BEFORE = "outbox_0006"
KEY_INDEX = "ix_outbox_messages_idempotency_key"
CONSTRAINT = "uq_outbox_messages_idempotency_key"


@pytest.fixture
def old_url(postgres_backend, tmp_path) -> Iterator[str]:
    """A PostgreSQL database at outbox_0006 with a row."""
    with fresh_database(postgres_backend, tmp_path, "atk3") as url:
        migrations.upgrade(url, BEFORE)
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.insert(messages).values(old_row(0, "pending")))
        engine.dispose()
        yield url


def _enqueue_twice(engine: sa.Engine, key: str) -> list[str]:
    """The app enqueues the same key twice (a retried request): the errors it got."""
    errors = []
    for _ in range(2):
        try:
            with Session(engine) as s, s.begin():
                Outbox().enqueue(s, email(1), key=key)
        except Exception as exc:  # what the caller would see
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    return errors


def test_racing_duplicate_enqueues_are_swallowed_while_the_upgrade_builds_the_key_index(old_url):
    """Found by the attack review (high), now guarded: while CREATE UNIQUE INDEX
    CONCURRENTLY ix_outbox_messages_idempotency_key runs (the autocommit upgrade's own
    build, and the build docs/guides/alembic.md tells operators to run beforehand), the new
    index is ready (written) but not valid, so it is not an arbiter of ``ON CONFLICT
    (idempotency_key) DO NOTHING`` yet every insert checks it with a hard unique check: two
    enqueues of one key racing get UniqueViolation raised into the caller's transaction
    instead of the duplicate being swallowed. A report's old snapshot keeps the build in
    that state (as a long build on a big table does anyway)."""
    engine = sa.create_engine(old_url, pool_size=12)
    report = engine.connect().execution_options(isolation_level="REPEATABLE READ")
    report_tx = report.begin()
    report.exec_driver_sql("SELECT 1").all()  # an old snapshot: a concurrent build waits for it
    failed: list[BaseException] = []

    def upgrade() -> None:
        try:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                migrations.upgrade(conn)
        except BaseException as exc:  # reported below
            failed.append(exc)

    upgrading = threading.Thread(target=upgrade, daemon=True)
    upgrading.start()
    deadline = time.monotonic() + 10
    building = False  # the key index written by inserts but no arbiter yet
    while time.monotonic() < deadline and upgrading.is_alive():
        with engine.connect() as conn:
            building = bool(
                conn.exec_driver_sql(
                    "SELECT indisready AND NOT indisvalid FROM pg_index "
                    f"WHERE indexrelid = to_regclass('{KEY_INDEX}')"
                ).scalar()
            )
        if building:
            break
        time.sleep(0.05)
    if not building:  # the key index is not built concurrently: let the upgrade end
        report_tx.rollback()
        report.close()
        upgrading.join(60)

    errors: list[str] = []
    threads, keys = 6, 1500 if building else 200
    barrier = threading.Barrier(threads)

    def app(_: int) -> None:
        for k in range(keys):
            try:
                barrier.wait(10)
            except threading.BrokenBarrierError:
                return
            try:
                with Session(engine) as s, s.begin():
                    Outbox().enqueue(s, email(k), key=f"retried-{k}")
            except Exception as exc:  # what the caller would see
                errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                barrier.abort()
                return

    try:
        apps = [threading.Thread(target=app, args=(i,)) for i in range(threads)]
        for a in apps:
            a.start()
        for a in apps:
            a.join(120)
    finally:
        if building:
            report_tx.rollback()
            report.close()
        upgrading.join(60)
        engine.dispose()
    assert errors == []
    assert failed == []


@pytest.mark.parametrize(
    "prebuilt",
    [
        # a typo'd pre-build of the guide's statement: another column
        f"CREATE UNIQUE INDEX {KEY_INDEX} ON outbox_messages (provider_message_id)",
        # the name taken by an index of another table (an archive copy) in the schema
        "CREATE TABLE outbox_messages_archive (idempotency_key varchar(255)); "
        f"CREATE UNIQUE INDEX {KEY_INDEX} ON outbox_messages_archive (idempotency_key)",
    ],
    ids=["other-column", "other-table"],
)
def test_a_prebuilt_key_index_that_does_not_guard_the_key_is_refused(old_url, prebuilt):
    """Found by the attack review (medium), now guarded: _check_key_index checks that an
    index of the name is valid, unique, on one column, without predicate or expression, but
    not that it is on outbox_messages nor on idempotency_key. CREATE ... IF NOT EXISTS then
    keeps the wrong index, the check passes and the key's constraint is dropped: the key is
    guarded by nothing and every enqueue fails ("no unique or exclusion constraint matching
    the ON CONFLICT specification")."""
    engine = sa.create_engine(old_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(prebuilt)
        try:
            migrations.upgrade(engine)
        except RuntimeError:
            with engine.connect() as conn:  # refused: the constraint is still there
                assert conn.exec_driver_sql(
                    f"SELECT 1 FROM pg_constraint WHERE conname = '{CONSTRAINT}'"
                ).scalar()
            return
        assert _enqueue_twice(engine, "order-7") == []
    finally:
        engine.dispose()


def test_the_offline_script_refuses_an_invalid_key_index_and_keeps_the_constraint(old_url):
    """Found by the attack review (medium), now guarded: ``alembic upgrade --sql`` (a DBA's
    script) skips _check_key_index, so the invalid index a failed CREATE INDEX CONCURRENTLY
    leaves behind (the guide's own failure case, "the upgrade refuses it by name") is kept
    by IF NOT EXISTS and the constraint dropped: afterwards every enqueue raises (no usable
    arbiter)."""
    engine = sa.create_engine(old_url)
    try:
        with engine.begin() as conn:  # what a failed concurrent build leaves
            conn.exec_driver_sql(
                f"CREATE UNIQUE INDEX {KEY_INDEX} "
                "ON outbox_messages (idempotency_key varchar_pattern_ops)"
            )
            conn.exec_driver_sql(
                f"UPDATE pg_index SET indisvalid = false WHERE indexrelid = '{KEY_INDEX}'::regclass"
            )
        config = migrations.alembic_config(old_url)
        out = io.StringIO()
        config.stdout = out
        with contextlib.redirect_stdout(out):
            command.upgrade(config, f"{BEFORE}:outbox_0007", sql=True)
        raw = engine.raw_connection()
        try:
            raw.driver_connection.autocommit = True
            raw.driver_connection.execute(out.getvalue())  # the DBA runs the script
        except Exception:
            return  # the script refused: fine
        finally:
            raw.invalidate()
        assert _enqueue_twice(engine, "order-8") == []
    finally:
        engine.dispose()


def test_the_upgrade_runs_in_a_second_schema_of_the_database(postgres_backend, tmp_path):
    """Found by the attack review (low), now guarded: _check_key_index looks the index up by
    name in every schema (its ``relnamespace`` condition compares the index's schema with
    its own table's, always true), so once one schema's outbox is at outbox_0007, upgrading
    the outbox of another schema of the same database (search_path) fails with
    MultipleResultsFound."""
    with fresh_database(postgres_backend, tmp_path, "atk3s") as url:
        admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql("CREATE SCHEMA tenant_a")
            conn.exec_driver_sql("CREATE SCHEMA tenant_b")
        admin.dispose()
        engines = {
            s: sa.create_engine(url, connect_args={"options": f"-c search_path={s}"})
            for s in ("tenant_a", "tenant_b")
        }
        try:
            for e in engines.values():
                migrations.upgrade(e, BEFORE)
            migrations.upgrade(engines["tenant_a"])
            migrations.upgrade(engines["tenant_b"])
            assert migrations.current_heads(engines["tenant_b"])[0] == {"outbox_0008"}
        finally:
            for e in engines.values():
                e.dispose()


def _preview_while_otto_waits(engine, users):
    """Olga's preview, taken once Otto's resolve waits on the row's lock."""
    deadline = time.monotonic() + 10
    while True:
        with engine.connect() as conn:
            waiting = conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND position('FOR UPDATE' in query) > 0"
            ).scalar_one()
        if waiting:
            break
        assert time.monotonic() < deadline
        time.sleep(0.02)

    c = client(engine, users)
    login(c, OLGA)
    page = c.get(
        "/actions/preview", params={"action": "resolve_delivered", "status": "unknown_outcome"}
    )
    assert 'id="chosen">1<' in page.text, page.text
    form = dict(HIDDEN.findall(page.text))

    return c, form


OLGA, OTTO = "olga@example.com", "otto@example.com"


@pytest.fixture
def users(tmp_path: Path) -> Path:
    return users_file(tmp_path, **{OTTO: Role.OPERATOR})


def test_a_bulk_resolve_leaves_alone_a_message_requeued_after_its_preview(postgres_backend, users):
    """Found by the attack review (medium), now guarded: a bulk resolve's guard is
    ``updated_at <= seen_at`` and resolve_one then takes the row in any resolvable status
    (pending and retrying included), not only unknown_outcome. A change that read its clock
    before the preview but committed after it (here Otto's resolve-as-not-delivered of the
    message, waiting on its row lock; the relay's reconcile requeue and the intake work the
    same way) carries an updated_at before seen_at: Olga's confirm then marks the requeued,
    pending message sent, so it is never sent again, though the preview said a message that
    moves before the confirm is left alone and only unknown_outcome messages are resolved in
    bulk."""
    engine = postgres_backend.engine
    [mid] = enqueue(engine, 1, short=True, prefix="ambiguous")
    shown = datetime.now(UTC) - timedelta(minutes=5)
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == mid)
            .values(status="unknown_outcome", updated_at=shown)
        )
    with engine.connect() as conn:
        version = conn.execute(sa.select(messages.c.updated_at).where(messages.c.id == mid))
        version = version.scalar_one()

    holder = engine.connect()  # something holds the row a moment (an intake batch, a report)
    holder_tx = holder.begin()
    holder.execute(sa.select(messages.c.id).where(messages.c.id == mid).with_for_update()).all()
    otto: list[object] = []

    def otto_resolves() -> None:
        try:
            otto.append(
                resolve_one(
                    engine,
                    mid,
                    delivered=False,
                    provider_message_id=None,
                    reason="SES says it bounced",
                    actor=OTTO,
                    unchanged_since=version,
                )
            )
        except Exception as exc:
            otto.append(exc)

    t = threading.Thread(target=otto_resolves)
    t.start()
    try:
        form = _preview_while_otto_waits(engine, users)
    finally:
        if holder_tx.is_active:
            holder_tx.rollback()
        holder.close()
        t.join(10)
    c, form = form
    assert isinstance(otto[0], dict), otto  # Otto requeued it: to be sent again
    with engine.connect() as conn:
        assert (
            conn.execute(sa.select(messages.c.status).where(messages.c.id == mid)).scalar_one()
            == "pending"
        )

    done = finished_job(
        c, c.post("/actions/apply", data={**form, "reason": "SES history"}, headers=SAME)
    )
    outcome = OUTCOME.findall(done.text)
    with engine.connect() as conn:
        status = conn.execute(sa.select(messages.c.status).where(messages.c.id == mid)).scalar_one()
    assert status == "pending", (status, outcome)  # Otto's requeue stands: it will be sent
