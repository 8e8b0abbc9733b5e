"""Suppression test data: addresses put on the list as the intake and the operators store
them, and a small email to send to them."""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa

from outbox.message import Email
from outbox.schema import suppressions

__all__ = ["mail", "suppress"]


def suppress(engine: sa.Engine, *addresses: str) -> None:
    """Suppress ``addresses`` as the intake and the operator commands store them."""
    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(
            sa.insert(suppressions),
            [
                {"address": a, "reason": "bounce", "created_at": now, "actor": "test"}
                for a in addresses
            ],
        )


def mail(**fields: object) -> Email:
    """A small order email to ann@example.com, with ``fields`` changed."""
    values: dict[str, object] = {
        "sender": "Shop <shop@example.com>",
        "to": ["ann@example.com"],
        "subject": "Order",
        "text": "Thanks.",
    }
    return Email(**{**values, **fields})  # type: ignore[arg-type]
