"""outbox: provider events, delivery status, suppressions, the operators' log, and their views

Revision ID: outbox_0003
Revises: outbox_0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "outbox_0003"
down_revision: str | Sequence[str] | None = "outbox_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DELIVERY_STATUSES = ("delayed", "delivered", "rejected", "suppressed", "bounced", "complained")
SUPPRESSION_REASONS = ("bounce", "complaint", "manual", "ses")


def _ts() -> sa.types.TypeEngine[datetime]:
    return sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _id() -> sa.types.TypeEngine[int]:
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":  # SQLite adds a CHECK only with its column
        op.execute(
            "ALTER TABLE outbox_messages ADD COLUMN delivery_status VARCHAR(20)"
            f" CONSTRAINT ck_outbox_messages_delivery_status"
            f" CHECK ({_one_of('delivery_status', DELIVERY_STATUSES)})"
        )
    else:
        op.add_column("outbox_messages", sa.Column("delivery_status", sa.String(20)))
        op.create_check_constraint(
            op.f("ck_outbox_messages_delivery_status"),
            "outbox_messages",
            _one_of("delivery_status", DELIVERY_STATUSES),
        )
    op.add_column("outbox_messages", sa.Column("delivery_status_at", _ts()))
    op.add_column("outbox_messages", sa.Column("reconcile_after", sa.Double()))
    op.create_index(
        op.f("ix_outbox_messages_provider_message_id"),
        "outbox_messages",
        ["provider_message_id"],
        postgresql_where=sa.text("provider_message_id IS NOT NULL"),
        sqlite_where=sa.text("provider_message_id IS NOT NULL"),
    )
    held = "status = 'unknown_outcome' AND reconcile_after IS NOT NULL"
    op.create_index(
        op.f("ix_outbox_messages_reconcile"),
        "outbox_messages",
        ["status", "send_started_at"],
        postgresql_where=sa.text(held),
        sqlite_where=sa.text(held),
    )
    op.add_column("outbox_attempts", sa.Column("dropped_recipients", sa.Text()))
    op.create_index(
        op.f("ix_outbox_attempts_provider_message_id"),
        "outbox_attempts",
        ["provider_message_id"],
        postgresql_where=sa.text("provider_message_id IS NOT NULL"),
        sqlite_where=sa.text("provider_message_id IS NOT NULL"),
    )
    op.create_table(
        "outbox_events",
        sa.Column("id", _id(), sa.Identity(), nullable=False),
        sa.Column("event_key", sa.String(64), nullable=False),
        sa.Column("received_at", _ts(), nullable=False),
        sa.Column("event_type", sa.String(30), nullable=False),
        sa.Column("event_at", _ts(), nullable=True),
        sa.Column("mail_at", _ts(), nullable=True),
        sa.Column("provider_message_id", sa.String(255), nullable=True),
        sa.Column("message_id", _id(), nullable=True),
        sa.Column("tagged_message_id", sa.String(64), nullable=True),
        sa.Column("claim_token", sa.String(36), nullable=True),
        sa.Column("detail", sa.String(255), nullable=True),
        sa.Column("recipients", sa.Text(), nullable=True),
        sa.Column("effect", sa.String(30), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("source", sa.String(20), nullable=False),
        sa.Column("intake_id", sa.String(255), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_events")),
        sa.UniqueConstraint("event_key", name=op.f("uq_outbox_events_event_key")),
        mysql_engine="InnoDB",
    )
    op.create_index(op.f("ix_outbox_events_message_id"), "outbox_events", ["message_id"])
    op.create_index(op.f("ix_outbox_events_received_at"), "outbox_events", ["received_at"])
    op.create_index(
        op.f("ix_outbox_events_deferred"),
        "outbox_events",
        ["effect", "received_at", "id"],
        postgresql_where=sa.text("effect = 'deferred'"),
        sqlite_where=sa.text("effect = 'deferred'"),
    )
    op.create_table(
        "outbox_suppressions",
        sa.Column(
            "address",
            sa.String(320).with_variant(
                mysql.VARCHAR(320, collation="utf8mb4_bin"), "mysql", "mariadb"
            ),
            nullable=False,
        ),
        sa.Column("reason", sa.String(20), nullable=False),
        sa.Column("detail", sa.String(255), nullable=True),
        sa.Column("event_id", _id(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.PrimaryKeyConstraint("address", name=op.f("pk_outbox_suppressions")),
        sa.CheckConstraint(
            _one_of("reason", SUPPRESSION_REASONS), name=op.f("ck_outbox_suppressions_reason")
        ),
        mysql_engine="InnoDB",
    )
    op.create_table(
        "outbox_intakes",
        sa.Column("intake_id", sa.String(255), nullable=False),
        sa.Column("queue_url", sa.Text(), nullable=False),
        sa.Column("visibility_timeout", sa.Double(), nullable=False),
        sa.Column("started_at", _ts(), nullable=False),
        sa.Column("heartbeat_at", _ts(), nullable=False),
        sa.Column("caught_up_at", _ts(), nullable=True),
        sa.PrimaryKeyConstraint("intake_id", name=op.f("pk_outbox_intakes")),
        mysql_engine="InnoDB",
    )
    op.create_table(
        "outbox_operator_actions",
        sa.Column("id", _id(), sa.Identity(), nullable=False),
        sa.Column("at", _ts(), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("action", sa.String(30), nullable=False),
        sa.Column("message_id", _id(), nullable=True),
        sa.Column("address", sa.String(320), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_operator_actions")),
        mysql_engine="InnoDB",
    )
    op.create_index(
        op.f("ix_outbox_operator_actions_message_id"), "outbox_operator_actions", ["message_id"]
    )
    for name, sql in _views(dialect).items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    for name in reversed(list(_views(dialect))):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    op.drop_table("outbox_operator_actions")
    op.drop_table("outbox_intakes")
    op.drop_table("outbox_suppressions")
    op.drop_table("outbox_events")
    op.drop_index(op.f("ix_outbox_attempts_provider_message_id"), "outbox_attempts")
    op.drop_column("outbox_attempts", "dropped_recipients")
    op.drop_index(op.f("ix_outbox_messages_reconcile"), "outbox_messages")
    op.drop_index(op.f("ix_outbox_messages_provider_message_id"), "outbox_messages")
    op.drop_column("outbox_messages", "reconcile_after")
    op.drop_column("outbox_messages", "delivery_status_at")
    if dialect != "sqlite":
        op.drop_constraint(
            op.f("ck_outbox_messages_delivery_status"), "outbox_messages", type_="check"
        )
    op.drop_column("outbox_messages", "delivery_status")


def _views(dialect: str) -> dict[str, str]:
    """The views over events, delivery and operators' actions, per dialect where time differs."""
    if dialect == "postgresql":
        day_ago = "now() - interval '24 hours'"

        def age(col: str) -> str:
            return f"EXTRACT(EPOCH FROM (now() - {col}))"

    elif dialect in ("mysql", "mariadb"):
        day_ago = "UTC_TIMESTAMP(6) - INTERVAL 24 HOUR"

        def age(col: str) -> str:
            return f"TIMESTAMPDIFF(MICROSECOND, {col}, UTC_TIMESTAMP(6)) / 1000000.0"

    else:
        day_ago = "strftime('%Y-%m-%d %H:%M:%f', 'now', '-24 hours')"

        def age(col: str) -> str:
            return f"(julianday('now') - julianday({col})) * 86400.0"

    def count(status: str) -> str:
        return f"SUM(CASE WHEN delivery_status = '{status}' THEN 1 ELSE 0 END)"

    def rate(status: str) -> str:
        return f"{count(status)} * 1.0 / COUNT(*)"

    return {
        "outbox_delivery_summary": (
            "SELECT category, COUNT(*) AS sent_count,"
            + "".join(f" {count(s)} AS {s}_count," for s in DELIVERY_STATUSES)
            + " SUM(CASE WHEN delivery_status IS NULL THEN 1 ELSE 0 END) AS no_event_count,"
            f" {rate('bounced')} AS bounce_rate, {rate('complained')} AS complaint_rate"
            f" FROM outbox_messages WHERE status = 'sent' AND sent_at >= {day_ago}"
            " GROUP BY category"
        ),
        "outbox_event_intake": (
            "SELECT COUNT(*) AS events_24h,"
            " SUM(CASE WHEN message_id IS NULL THEN 1 ELSE 0 END) AS unmatched_24h,"
            " SUM(CASE WHEN event_type = 'malformed' THEN 1 ELSE 0 END) AS malformed_24h,"
            " (SELECT MAX(received_at) FROM outbox_events) AS newest_received_at,"
            f" (SELECT {age('MAX(received_at)')} FROM outbox_events) AS newest_age_seconds,"
            " (SELECT e.event_at FROM outbox_events e ORDER BY e.received_at DESC, e.id DESC"
            " LIMIT 1) AS newest_event_at"
            f" FROM outbox_events WHERE received_at >= {day_ago}"
        ),
        "outbox_operator_log": (
            "SELECT id, at, actor, action, message_id, address, reason, detail"
            " FROM outbox_operator_actions"
        ),
    }
