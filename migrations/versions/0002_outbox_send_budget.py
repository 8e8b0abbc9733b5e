"""outbox: the send budget relays share for --max-send-rate

Revision ID: outbox_0002
Revises: outbox_0001
Create Date: 2026-12-08
"""

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "outbox_0002"
down_revision: str | Sequence[str] | None = "outbox_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts() -> sa.types.TypeEngine[datetime]:
    return sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _id() -> sa.types.TypeEngine[int]:
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "outbox_send_budget",
        sa.Column("id", _id(), sa.Identity(), nullable=False),
        sa.Column("relay_id", sa.String(255), nullable=False),
        sa.Column("reserved_at", _ts(), nullable=False),
        sa.Column("recipients", sa.Integer(), nullable=False),
        sa.Column("occupied_until", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_send_budget")),
        mysql_engine="InnoDB",
    )
    op.create_index(
        op.f("ix_outbox_send_budget_occupied_until"), "outbox_send_budget", ["occupied_until"]
    )
    lock = op.create_table(
        "outbox_send_budget_lock",
        sa.Column("id", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_send_budget_lock")),
        mysql_engine="InnoDB",
    )
    op.bulk_insert(lock, [{"id": 1}])


def downgrade() -> None:
    op.drop_table("outbox_send_budget_lock")
    op.drop_table("outbox_send_budget")  # its index goes with it
