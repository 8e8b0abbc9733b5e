"""outbox: tables, indexes and operator views

Revision ID: outbox_0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op
from alembic.util import CommandError
from sqlalchemy.dialects import mysql

from outbox.exceptions import ConfigurationError

revision: str = "outbox_0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = ("outbox",)
depends_on: str | Sequence[str] | None = None

STATUSES = (
    "pending",
    "retrying",
    "processing",
    "sent",
    "failed",
    "unknown_outcome",
    "cancelled",
    "expired",
)
CLAIMABLE = "status IN ('pending', 'retrying')"


def _ts() -> sa.types.TypeEngine[datetime]:
    return sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _id() -> sa.types.TypeEngine[int]:
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


STANDALONE_VERSION_TABLE = "outbox_alembic_version"  # outbox.migrations.VERSION_TABLE
APP_VERSION_TABLE = "alembic_version"  # alembic's default, where an app's alembic records


def _refuse_a_schema_recorded_elsewhere() -> None:
    """The outbox schema exists already, its revisions recorded by the other way of migrating
    (``outbox-relay migrate`` in ``outbox_alembic_version``, or the app's alembic in its own
    version table): say what to do, instead of failing on "table outbox_messages already
    exists" (in the app's alembic, half way through its upgrade)."""
    context = op.get_context()
    if context.as_sql:  # offline (`--sql`): no database to look at
        return
    bind = op.get_bind()
    standalone = context.version_table == STANDALONE_VERSION_TABLE
    other = APP_VERSION_TABLE if standalone else STANDALONE_VERSION_TABLE
    inspector = sa.inspect(bind)
    applied: list[str] = []
    if inspector.has_table(other):
        version = sa.table(other, sa.column("version_num"))
        recorded = bind.execute(
            sa.select(version.c.version_num).where(version.c.version_num.like("outbox%"))
        )
        applied = sorted(recorded.scalars())
    if not applied and standalone and inspector.has_table("outbox_messages"):
        # recorded by no outbox_* revision: the app's own revisions carry the outbox
        # (outbox-relay alembic-revision)
        raise ConfigurationError(
            "--database-url",
            "the outbox tables of this database were created by your app's alembic: keep "
            "them up to date with `alembic upgrade head` (run `outbox-relay alembic-revision` "
            "after upgrading sqlalchemy-outbox), not outbox-relay migrate",
        )
    if not applied:
        return
    if standalone:
        raise ConfigurationError(
            "--database-url",
            f"the outbox schema of this database is in your app's alembic (its {other} holds "
            f"{', '.join(applied)}): keep it up to date with `alembic upgrade heads`, not "
            "outbox-relay migrate",
        )
    raise CommandError(
        "the outbox schema of this database was created by `outbox-relay migrate` (its "
        f"revisions are in {other}: {', '.join(applied)}); to carry it on in your alembic, "
        f"run `alembic stamp {' '.join(applied)}` (the outbox as a branch of its own) or "
        "`alembic stamp <your revision carrying them>` (on your branch: outbox-relay "
        f"alembic-revision), drop the table {other}, then upgrade again"
    )


def upgrade() -> None:
    _refuse_a_schema_recorded_elsewhere()
    op.create_table(
        "outbox_messages",
        sa.Column("id", _id(), sa.Identity(), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=False),
        sa.Column("category", sa.String(64), nullable=False),
        sa.Column("priority", sa.SmallInteger(), server_default="0", nullable=False),
        sa.Column("status", sa.String(20), server_default="pending", nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("recipients", sa.Text(), nullable=False),
        sa.Column("recipient_count", sa.SmallInteger(), nullable=False),
        sa.Column("subject", sa.Text(), nullable=True),
        sa.Column("attempt_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("backoff_base", sa.Double(), nullable=False),
        sa.Column("backoff_cap", sa.Double(), nullable=False),
        sa.Column("ambiguity_policy", sa.String(10), nullable=False),
        sa.Column("next_attempt_at", _ts(), nullable=False),
        sa.Column("expires_at", _ts(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.Column("updated_at", _ts(), nullable=False),
        sa.Column("claim_token", sa.String(36), nullable=True),
        sa.Column("claimed_by", sa.String(255), nullable=True),
        sa.Column("claimed_at", _ts(), nullable=True),
        sa.Column("lease_expires_at", _ts(), nullable=True),
        sa.Column("send_started_at", _ts(), nullable=True),
        sa.Column("last_attempt_at", _ts(), nullable=True),
        sa.Column("sent_at", _ts(), nullable=True),
        sa.Column("provider_message_id", sa.String(255), nullable=True),
        sa.Column("last_error_code", sa.String(100), nullable=True),
        sa.Column("last_error_message", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_messages")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_outbox_messages_idempotency_key")),
        sa.CheckConstraint(
            "status IN (" + ", ".join(f"'{s}'" for s in STATUSES) + ")",
            name=op.f("ck_outbox_messages_status"),
        ),
        sa.CheckConstraint(
            "ambiguity_policy IN ('hold', 'resend')",
            name=op.f("ck_outbox_messages_ambiguity_policy"),
        ),
        mysql_engine="InnoDB",
    )
    op.create_index(
        op.f("ix_outbox_messages_claim"),
        "outbox_messages",
        ["status", "priority", "next_attempt_at", "id"],
        postgresql_where=sa.text(CLAIMABLE),
        sqlite_where=sa.text(CLAIMABLE),
    )
    op.create_index(
        op.f("ix_outbox_messages_lease"),
        "outbox_messages",
        ["status", "lease_expires_at"],
        postgresql_where=sa.text("status = 'processing'"),
        sqlite_where=sa.text("status = 'processing'"),
    )
    op.create_table(
        "outbox_attempts",
        sa.Column("id", _id(), sa.Identity(), nullable=False),
        sa.Column("message_id", _id(), nullable=False),
        sa.Column("claim_token", sa.String(36), nullable=True),
        sa.Column("relay_id", sa.String(255), nullable=True),
        sa.Column("started_at", _ts(), nullable=True),
        sa.Column("finished_at", _ts(), nullable=False),
        sa.Column("outcome", sa.String(30), nullable=False),
        sa.Column("error_code", sa.String(100), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("provider_message_id", sa.String(255), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_attempts")),
        sa.ForeignKeyConstraint(
            ["message_id"],
            ["outbox_messages.id"],
            name=op.f("fk_outbox_attempts_message_id_outbox_messages"),
            ondelete="CASCADE",
        ),
        mysql_engine="InnoDB",
    )
    op.create_index(op.f("ix_outbox_attempts_message_id"), "outbox_attempts", ["message_id"])
    op.create_table(
        "outbox_relays",
        sa.Column("relay_id", sa.String(255), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", _ts(), nullable=False),
        sa.Column("heartbeat_at", _ts(), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.PrimaryKeyConstraint("relay_id", name=op.f("pk_outbox_relays")),
        mysql_engine="InnoDB",
    )
    for name, sql in _views(op.get_bind().dialect.name).items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def downgrade() -> None:
    for name in reversed(list(_views(op.get_bind().dialect.name))):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    op.drop_table("outbox_relays")
    op.drop_table("outbox_attempts")  # its indexes and foreign key go with it
    op.drop_table("outbox_messages")


def _views(dialect: str) -> dict[str, str]:
    """The operator views, written once per dialect only where SQL differs (time, aggregation)."""
    if dialect == "postgresql":
        now = "now()"

        def age(col: str) -> str:
            return f"EXTRACT(EPOCH FROM (now() - {col}))"

        def ids(col: str) -> str:
            return f"string_agg({col}, ',' ORDER BY a.id)"

    elif dialect in ("mysql", "mariadb"):
        now = "UTC_TIMESTAMP(6)"

        def age(col: str) -> str:
            return f"TIMESTAMPDIFF(MICROSECOND, {col}, UTC_TIMESTAMP(6)) / 1000000.0"

        def ids(col: str) -> str:
            return f"GROUP_CONCAT({col} ORDER BY a.id SEPARATOR ',')"

    else:
        now = "strftime('%Y-%m-%d %H:%M:%f', 'now')"

        def age(col: str) -> str:
            return f"(julianday('now') - julianday({col})) * 86400.0"

        def ids(col: str) -> str:
            return f"group_concat({col}, ',')"

    return {
        "outbox_status_summary": (
            "SELECT category, status, COUNT(*) AS message_count,"
            " MIN(created_at) AS oldest_created_at,"
            " MIN(next_attempt_at) AS oldest_next_attempt_at"
            " FROM outbox_messages GROUP BY category, status"
        ),
        "outbox_lag": (
            "SELECT category, COUNT(*) AS due_count,"
            " MIN(next_attempt_at) AS oldest_due_at,"
            f" {age('MIN(next_attempt_at)')} AS lag_seconds"
            f" FROM outbox_messages WHERE {CLAIMABLE} AND next_attempt_at <= {now}"
            " GROUP BY category"
        ),
        "outbox_unknown_outcomes": (
            "SELECT m.id, m.idempotency_key, m.category, m.recipients, m.subject,"
            " m.claimed_by, m.claimed_at, m.send_started_at, m.attempt_count,"
            f" (SELECT {ids('a.provider_message_id')} FROM outbox_attempts a"
            "   WHERE a.message_id = m.id AND a.provider_message_id IS NOT NULL)"
            " AS provider_message_ids,"
            " m.last_error_code, m.last_error_message, m.updated_at"
            " FROM outbox_messages m WHERE m.status = 'unknown_outcome'"
        ),
        "outbox_failures": (
            "SELECT g.category, g.error_code, g.message_count, g.newest_at,"
            " g.newest_message_id, m.last_error_message AS newest_error_message"
            " FROM (SELECT category, last_error_code AS error_code, COUNT(*) AS message_count,"
            "   MAX(updated_at) AS newest_at, MAX(id) AS newest_message_id"
            "   FROM outbox_messages WHERE status = 'failed'"
            "   GROUP BY category, last_error_code) g"
            " JOIN outbox_messages m ON m.id = g.newest_message_id"
        ),
        "outbox_relay_health": (
            "SELECT relay_id, host, pid, state, started_at, heartbeat_at,"
            f" {age('heartbeat_at')} AS heartbeat_age_seconds"
            " FROM outbox_relays"
        ),
    }
