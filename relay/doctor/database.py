"""The database's checks: reachable and migrated (:func:`check_database`), the role's grants
read from the server's catalog (:func:`check_grants`), and the From addresses the newest
messages name (:func:`identities_in_use`)."""

from __future__ import annotations

import email.utils
from collections.abc import Iterable

import sqlalchemy as sa

from outbox.migrations import current_heads
from relay import store
from relay.db import masked_url
from relay.doctor.report import Check, Level, first_line

__all__ = ["RELAY_GRANTS", "check_database", "check_grants", "identities_in_use"]

_SENDERS_READ = 1000  # the newest messages whose From addresses doctor checks

# What the relay's statements need, as examples/deploy/grants-*.sql grant it: (privilege,
# table, columns or None for the whole table). The intake's needs apply with a queue only.
_MESSAGE_COLUMNS = (
    "status",
    "claim_token",
    "claimed_by",
    "claimed_at",
    "lease_expires_at",
    "send_started_at",
    "attempt_count",
    "next_attempt_at",
    "last_attempt_at",
    "last_error_code",
    "last_error_message",
    "sent_at",
    "provider_message_id",
    "delivery_status",
    "delivery_status_at",
    "updated_at",
    "fair_at",
)
_RUN_GRANTS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    *(
        ("SELECT", table, None)
        for table in (
            "outbox_messages",
            "outbox_attempts",
            "outbox_relays",
            "outbox_send_budget",
            "outbox_send_budget_lock",
            "outbox_send_slots",
            "outbox_suppressions",
            "outbox_lag",
            "outbox_delivery_summary",
        )
    ),
    ("UPDATE", "outbox_messages", _MESSAGE_COLUMNS),
    *(
        ("INSERT", table, None)
        for table in (
            "outbox_attempts",
            "outbox_relays",
            "outbox_send_budget",
            "outbox_send_budget_lock",
            "outbox_send_slots",
        )
    ),
    (
        "UPDATE",
        "outbox_relays",
        ("host", "pid", "started_at", "heartbeat_at", "state", "paused_scopes"),
    ),
    ("UPDATE", "outbox_send_budget_lock", ("id",)),
    ("DELETE", "outbox_send_budget", None),
    ("DELETE", "outbox_send_slots", None),
)
_INTAKE_GRANTS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("SELECT", "outbox_events", None),
    ("SELECT", "outbox_intakes", None),
    ("SELECT", "outbox_event_intake", None),
    ("INSERT", "outbox_events", None),
    ("INSERT", "outbox_suppressions", None),
    ("INSERT", "outbox_intakes", None),
    ("UPDATE", "outbox_events", ("effect",)),
    (
        "UPDATE",
        "outbox_intakes",
        ("queue_url", "visibility_timeout", "started_at", "heartbeat_at", "caught_up_at"),
    ),
)
RELAY_GRANTS = (*_RUN_GRANTS, *_INTAKE_GRANTS)


def check_database(engine: sa.Engine) -> tuple[Check, bool]:
    """Reachable, the outbox tables there, the migrations at head; and whether the schema is
    usable for the checks that read it."""
    where = masked_url(engine.url)
    migrate = f"run `outbox-relay migrate --database-url ...` (as the schema's owner) on {where}"
    try:
        with engine.connect() as conn:
            missing = store.missing_tables(conn)
    except sa.exc.DBAPIError as exc:
        found = f"cannot connect to {where}: {first_line(exc)}"
        return Check(
            check="database",
            status=Level.FAIL,
            found=found,
            fix="check --database-url, that the server runs and accepts this login",
        ), False
    if missing:
        what = (
            "no outbox schema"
            if set(missing) == set(store.OUTBOX_TABLES)
            else f"the outbox tables {', '.join(missing)} missing"
        )
        return Check(
            check="database", status=Level.FAIL, found=f"{where}: {what}", fix=migrate
        ), False
    try:
        applied, heads = current_heads(engine)
    except sa.exc.DBAPIError as exc:  # the relay's role need not read the version table
        return Check(
            check="database",
            status=Level.WARN,
            found=f"{where}, outbox tables present; could not check the revision: "
            f"{first_line(exc)}",
            fix="run doctor as the schema's owner to check the migrations",
        ), True
    at = ", ".join(sorted(applied)) or "no recorded revision"
    if applied == heads:
        return Check(
            check="database", status=Level.OK, found=f"{where}, schema at {at} (head)"
        ), True
    if applied - heads and not heads - applied:
        return Check(
            check="database",
            status=Level.WARN,
            found=f"{where}: schema at {at}, newer than this release's {', '.join(sorted(heads))}",
            fix="run the relay release that migrated it",
        ), True
    return Check(
        check="database",
        status=Level.FAIL,
        found=f"{where}: schema at {at}, not at head {', '.join(sorted(heads))}",
        fix=migrate,
    ), True


def check_grants(engine: sa.Engine, *, intake: bool) -> Check:
    """The privileges the relay's statements need (with ``intake``, the event intake's too),
    read from the server's catalog without writing anything."""
    needs = RELAY_GRANTS if intake else _RUN_GRANTS
    dialect = engine.dialect.name
    if dialect == "sqlite":
        return Check(check="grants", status=Level.OK, found="n/a: SQLite has no roles")
    try:
        with engine.connect() as conn:
            if dialect == "postgresql":
                missing, hidden = _missing_postgresql(conn, needs), ""
            elif dialect in ("mysql", "mariadb"):
                missing, hidden = _missing_mysql(conn, needs)
            else:
                return Check(
                    check="grants",
                    status=Level.WARN,
                    found=f"could not check: no privilege query for {dialect}",
                )
    except sa.exc.DBAPIError as exc:
        return Check(check="grants", status=Level.WARN, found=f"could not check: {first_line(exc)}")
    script = f"examples/deploy/grants-{'postgresql' if dialect == 'postgresql' else 'mariadb'}.sql"
    if not missing:
        return Check(check="grants", status=Level.OK, found="every privilege the relay needs")
    found = f"the role lacks {'; '.join(missing)}"
    if hidden:  # a role's grants that information_schema does not show may cover them
        return Check(
            check="grants",
            status=Level.WARN,
            found=f"{found} (could not check the grants of the enabled roles {hidden})",
            fix=f"grant them as {script} does, or check SHOW GRANTS",
        )
    return Check(check="grants", status=Level.FAIL, found=found, fix=f"grant them as {script} does")


def _needed(
    needs: Iterable[tuple[str, str, tuple[str, ...] | None]],
) -> Iterable[tuple[str, str, str | None]]:
    for privilege, table, columns in needs:
        for column in columns or (None,):
            yield privilege, table, column


def _describe(missing: Iterable[tuple[str, str, str | None]]) -> list[str]:
    """``UPDATE (a, b) ON t``, ``SELECT ON u``: the missing privileges, grouped."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for privilege, table, column in missing:
        grouped.setdefault((privilege, table), [])
        if column is not None:
            grouped[(privilege, table)].append(column)
    return [
        f"{p} ({', '.join(cols)}) ON {t}" if cols else f"{p} ON {t}"
        for (p, t), cols in grouped.items()
    ]


def _missing_postgresql(
    conn: sa.Connection, needs: Iterable[tuple[str, str, tuple[str, ...] | None]]
) -> list[str]:
    """has_table_privilege / has_column_privilege of the current role (its roles' included),
    the tables found along its search_path as the relay's statements find them."""
    wanted = list(_needed(needs))
    parts, params = [], {}
    for n, (privilege, table, column) in enumerate(wanted):
        params[f"t{n}"], params[f"p{n}"] = table, privilege
        if column is None:
            parts.append(f"has_table_privilege(:t{n}, :p{n})")
        else:
            params[f"c{n}"] = column
            parts.append(f"has_column_privilege(:t{n}, :c{n}, :p{n})")
    held = conn.execute(sa.text(f"SELECT {', '.join(parts)}"), params).one()
    return _describe(w for w, ok in zip(wanted, held, strict=True) if not ok)


def _missing_mysql(
    conn: sa.Connection, needs: Iterable[tuple[str, str, tuple[str, ...] | None]]
) -> tuple[list[str], str]:
    """The current account's privileges from information_schema (global, this schema, each
    table, each column), and the enabled roles, whose grants it does not show."""
    grantee = sa.text(
        "SELECT CONCAT('''', SUBSTRING_INDEX(CURRENT_USER(), '@', 1), '''@''', "
        "SUBSTRING_INDEX(CURRENT_USER(), '@', -1), ''''), DATABASE()"
    )
    who, schema = conn.execute(grantee).one()
    where = {"who": who, "schema": schema}
    held: set[tuple[str, str | None, str | None]] = set()
    for (privilege,) in conn.execute(
        sa.text(
            "SELECT privilege_type FROM information_schema.user_privileges WHERE grantee = :who"
        ),
        where,
    ):
        held.add((privilege, None, None))
    for (privilege,) in conn.execute(
        sa.text(
            "SELECT privilege_type FROM information_schema.schema_privileges "
            "WHERE grantee = :who AND table_schema = :schema"
        ),
        where,
    ):
        held.add((privilege, None, None))
    for privilege, table in conn.execute(
        sa.text(
            "SELECT privilege_type, table_name FROM information_schema.table_privileges "
            "WHERE grantee = :who AND table_schema = :schema"
        ),
        where,
    ):
        held.add((privilege, table, None))
    for privilege, table, column in conn.execute(
        sa.text(
            "SELECT privilege_type, table_name, column_name "
            "FROM information_schema.column_privileges "
            "WHERE grantee = :who AND table_schema = :schema"
        ),
        where,
    ):
        held.add((privilege, table, column))
    enabled = sa.text("SELECT role_name FROM information_schema.enabled_roles")
    roles = ", ".join(r for r in conn.execute(enabled).scalars() if r)  # NULL: no role

    def has(privilege: str, table: str, column: str | None) -> bool:
        return bool(
            {(privilege, None, None), (privilege, table, None), (privilege, table, column)} & held
        )

    return _describe(w for w in _needed(needs) if not has(*w)), roles


def identities_in_use(engine: sa.Engine) -> tuple[list[str], list[str]]:
    """The From addresses and configuration sets named by the newest messages, each once,
    in the order first seen."""
    with engine.connect() as conn:
        payloads = store.recent_payloads(conn, limit=_SENDERS_READ)
    senders: dict[str, None] = {}
    sets: dict[str, None] = {}
    for payload in payloads:
        if not isinstance(payload, dict):
            continue
        address = email.utils.parseaddr(str(payload.get("sender") or ""))[1].lower()
        if "@" in address:
            senders[address] = None
        if payload.get("configuration_set"):
            sets[str(payload["configuration_set"])] = None
    return list(senders), list(sets)
