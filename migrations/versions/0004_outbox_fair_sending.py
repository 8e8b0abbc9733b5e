"""outbox: fair sending (a fairness key and a turn per message, budgets and slots per scope)

Revision ID: outbox_0004
Revises: outbox_0003
Create Date: 2026-12-05

Adding the columns rewrites no row: ``fair_at`` has a constant default (instant on PostgreSQL
11+ and MariaDB 10.3+). Only the queued rows (pending, retrying, processing) are given their
turn, ``next_attempt_at``, which keeps their order; a row written by an app not yet upgraded
gets the default, first in line, until the app runs this version.

The view ``outbox_fairness`` has one row per fairness key of the queued messages (the unkeyed
ones as the key NULL): due now, queued, in flight, and how long the oldest due one has waited.
"""

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "outbox_0004"
down_revision: str | Sequence[str] | None = "outbox_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUEUED = "status IN ('pending', 'retrying', 'processing')"
CLAIMABLE = "status IN ('pending', 'retrying')"
FAIR_AT_DEFAULT = "1970-01-01 00:00:00"
SCOPE_CHARS = 400


def _ts() -> sa.types.TypeEngine[datetime]:
    return sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _id() -> sa.types.TypeEngine[int]:
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _exact(length: int) -> sa.types.TypeEngine[str]:
    """Compared byte for byte (MariaDB's default collation would merge "Acme" and "acme ")."""
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, collation="utf8mb4_bin"), "mysql", "mariadb"
    )


def upgrade() -> None:
    op.add_column("outbox_messages", sa.Column("fairness_key", _exact(255)))
    op.add_column(
        "outbox_messages",
        sa.Column("fair_at", _ts(), nullable=False, server_default=FAIR_AT_DEFAULT),
    )
    op.add_column("outbox_messages", sa.Column("line_at", _ts()))
    op.execute(f"UPDATE outbox_messages SET fair_at = next_attempt_at WHERE {QUEUED}")
    op.drop_index(op.f("ix_outbox_messages_claim"), "outbox_messages")
    op.create_index(
        op.f("ix_outbox_messages_claim"),
        "outbox_messages",
        ["status", "priority", "fair_at", "id", "next_attempt_at"],
        postgresql_where=sa.text(CLAIMABLE),
        sqlite_where=sa.text(CLAIMABLE),
    )
    keyed = "status = 'pending' AND line_at IS NOT NULL"
    op.create_index(
        op.f("ix_outbox_messages_fairness"),
        "outbox_messages",
        ["fairness_key", "status", "priority", "line_at"],
        postgresql_where=sa.text(keyed),
        sqlite_where=sa.text(keyed),
    )
    op.add_column(
        "outbox_send_budget",
        sa.Column("scope", _exact(SCOPE_CHARS), nullable=False, server_default=""),
    )
    op.create_table(
        "outbox_send_slots",
        sa.Column("id", _id(), sa.Identity(), nullable=False),
        sa.Column("scope", _exact(SCOPE_CHARS), nullable=False),
        sa.Column("message_id", _id(), nullable=False),
        sa.Column("claim_token", sa.String(36), nullable=False),
        sa.Column("taken_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_send_slots")),
        mysql_engine="InnoDB",
    )
    op.create_index(op.f("ix_outbox_send_slots_scope"), "outbox_send_slots", ["scope"])
    for name, sql in _views(op.get_bind().dialect.name).items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def downgrade() -> None:
    for name in reversed(list(_views(op.get_bind().dialect.name))):
        op.execute(f"DROP VIEW IF EXISTS {name}")  # before the columns it reads
    op.drop_table("outbox_send_slots")  # its index goes with it
    op.drop_column("outbox_send_budget", "scope")
    op.drop_index(op.f("ix_outbox_messages_fairness"), "outbox_messages")
    op.drop_index(op.f("ix_outbox_messages_claim"), "outbox_messages")
    op.create_index(
        op.f("ix_outbox_messages_claim"),
        "outbox_messages",
        ["status", "priority", "next_attempt_at", "id"],
        postgresql_where=sa.text(CLAIMABLE),
        sqlite_where=sa.text(CLAIMABLE),
    )
    op.drop_column("outbox_messages", "line_at")
    op.drop_column("outbox_messages", "fair_at")
    op.drop_column("outbox_messages", "fairness_key")


def _views(dialect: str) -> dict[str, str]:
    """The view of the queue by fairness key, per dialect where time differs."""
    if dialect == "postgresql":
        now = "now()"

        def age(col: str) -> str:
            return f"EXTRACT(EPOCH FROM (now() - {col}))"

    elif dialect in ("mysql", "mariadb"):
        now = "UTC_TIMESTAMP(6)"

        def age(col: str) -> str:
            return f"TIMESTAMPDIFF(MICROSECOND, {col}, UTC_TIMESTAMP(6)) / 1000000.0"

    else:
        now = "strftime('%Y-%m-%d %H:%M:%f', 'now')"

        def age(col: str) -> str:
            return f"(julianday('now') - julianday({col})) * 86400.0"

    # due as outbox_lag counts it: claimable, next_attempt_at passed
    due = f"{CLAIMABLE} AND next_attempt_at <= {now}"
    oldest_due = f"MIN(CASE WHEN {due} THEN next_attempt_at END)"
    return {
        "outbox_fairness": (
            "SELECT fairness_key,"
            f" SUM(CASE WHEN {due} THEN 1 ELSE 0 END) AS due_count,"
            f" SUM(CASE WHEN {CLAIMABLE} THEN 1 ELSE 0 END) AS queued_count,"
            " SUM(CASE WHEN status = 'processing' THEN 1 ELSE 0 END) AS processing_count,"
            f" {oldest_due} AS oldest_due_at,"
            f" COALESCE({age(oldest_due)}, 0) AS lag_seconds"
            f" FROM outbox_messages WHERE {QUEUED} GROUP BY fairness_key"
        ),
    }
