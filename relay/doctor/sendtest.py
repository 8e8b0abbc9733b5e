"""``outbox-relay send-test``'s message: enqueued as an app enqueues it
(:func:`enqueue_test`), then followed in its row until it is sent or delivered, fails, or the
wait runs out (:func:`watch`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox.category import Category
from outbox.exceptions import ConfigurationError, InvalidEmail
from outbox.message import Email
from outbox.schema import DeliveryStatus, Status
from outbox.session import Outbox
from relay import store
from relay.clock import read_database_time

__all__ = ["TEST_CATEGORY", "Outcome", "enqueue_test", "watch"]

TEST_CATEGORY = "outbox-test"
_LIVE = timedelta(seconds=60)  # a relay or intake that beat this recently is running


def enqueue_test(engine: sa.Engine, *, to: str, sender: str) -> tuple[int, str]:
    """Enqueue one test message as an app does (``Outbox.enqueue`` in a transaction, which
    also wakes a relay on PostgreSQL); (its id, its key). A bad address is a
    :class:`ConfigurationError` naming ``--to`` or ``--from``."""
    key = f"{TEST_CATEGORY}:{uuid.uuid4()}"
    outbox = Outbox(categories=[Category(name=TEST_CATEGORY, max_attempts=3)])
    try:
        message = Email(
            sender=sender,
            to=[to],
            subject=f"outbox-relay send-test {key}",
            text="A test message from outbox-relay send-test. Nothing to do.",
        )
    except InvalidEmail as exc:
        raise ConfigurationError(
            "--from" if exc.field == "sender" else "--to", exc.reason
        ) from None
    with Session(engine) as session, session.begin():
        result = outbox.enqueue(session, message, key=key, category=TEST_CATEGORY)
    return result.id, key


_GIVEN_UP = frozenset(
    {
        Status.FAILED.value,
        Status.UNKNOWN_OUTCOME.value,
        Status.CANCELLED.value,
        Status.EXPIRED.value,
    }
)
_BAD_DELIVERY = frozenset(
    {
        DeliveryStatus.REJECTED.value,
        DeliveryStatus.SUPPRESSED.value,
        DeliveryStatus.BOUNCED.value,
        DeliveryStatus.COMPLAINED.value,
    }
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """Where a test message stopped: ``ok`` and the last state seen (status, delivery)."""

    ok: bool
    state: str
    why: str


def watch(
    engine: sa.Engine,
    message_id: int,
    *,
    wait: float,
    echo: Callable[[str], None],
    poll: float = 0.25,
) -> Outcome:
    """Follow the message until it is sent (and, while an event intake runs, until its
    Delivery event), fails, or ``wait`` seconds pass; each change of state is echoed."""
    deadline = time.monotonic() + wait
    with engine.connect() as conn:
        relays, intakes = store.live_heartbeats(conn, since=read_database_time(conn) - _LIVE)
    if not relays:
        echo(
            f"message {message_id}: no relay has a heartbeat in the last {_LIVE.seconds} s: "
            "waiting anyway (start `outbox-relay run`)"
        )
    seen = None
    while True:
        with engine.connect() as conn:
            row, _ = store.get_message(conn, message_id)
        if row is None:
            return Outcome(ok=False, state="gone", why="the message is gone (pruned?)")
        state = (
            row.status if row.delivery_status is None else f"{row.status}, {row.delivery_status}"
        )
        if state != seen:
            seen = state
            extra = f" (provider id {row.provider_message_id})" if row.provider_message_id else ""
            error = (
                f": {row.last_error_code} {row.last_error_message or ''}".rstrip()
                if row.last_error_code
                else ""
            )
            echo(f"message {message_id}: {state}{extra}{error}")
        if row.status in _GIVEN_UP or row.delivery_status in _BAD_DELIVERY:
            return Outcome(
                ok=False, state=state, why=f"it ended {state}; see `outbox-relay show {message_id}`"
            )
        if row.delivery_status == DeliveryStatus.DELIVERED.value:
            return Outcome(ok=True, state=state, why="delivered")
        if row.status == Status.SENT.value and not intakes:
            return Outcome(
                ok=True, state=state, why="sent; no event intake runs, so delivery is not confirmed"
            )
        if time.monotonic() >= deadline:
            waiting = (
                "its Delivery event (check doctor's event destination line)"
                if row.status == Status.SENT.value
                else "a relay to send it" + ("" if relays else " (none is running)")
            )
            return Outcome(
                ok=False, state=state, why=f"timed out after {wait:g} s waiting for {waiting}"
            )
        time.sleep(poll)
