"""Hostile and unlucky inputs against the event intake, each a way the intake once broke one of
the outbox's promises: nothing committed is silently lost, nothing is sent twice
automatically, and bad input never crashes nor loses a queue message.

Each test states what must hold; each failed against the intake it was written for and passes
since the mechanism it names was fixed, so a regression of that mechanism fails it. Events are
AWS's documented examples (``tests/fixtures/ses_events``), read by the intake's own parser and
applied with ``apply_events`` the way the loop does; sends go through an in-process relay.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import pytest
import sqlalchemy as sa

from outbox import AmbiguityPolicy, Category, Outbox
from outbox.schema import attempts, messages, suppressions
from relay import store
from relay.clock import read_database_time
from relay.events import SesEvent, parse
from relay.intake import Effect, apply_deferred, apply_events
from relay.metrics import _read_intake
from relay.senders import Accepted, Ambiguous, Outcome, OutgoingMessage
from relay.testing import FakeSender
from tests.support.db import Backend, attempt_rows, row
from tests.support.factories import enqueue
from tests.support.inprocess import closing, relay_for, settle
from tests.support.sqs import ses_event, sns_body

WINDOW = 60.0
OUTBOX = Outbox(
    categories=[
        Category(name="receipts", ambiguity=AmbiguityPolicy.RECONCILE, reconcile_after=WINDOW)
    ]
)


def held(backend: Backend) -> int:
    """A reconcile message whose one send was ambiguous (unknown_outcome)."""
    (mid,) = enqueue(backend.engine, 1, outbox=OUTBOX, category="receipts")
    relay = relay_for(backend, FakeSender(lambda m: Ambiguous(code="ReadTimeout")))
    with closing(relay):
        settle(relay)
        settle(relay)
    assert row(backend.engine, mid).status == "unknown_outcome"
    return mid


def sent_row(backend: Backend, provider_id: str, to: str = "customer0@example.com") -> int:
    (mid,) = enqueue(backend.engine, 1, to=[to])
    with backend.engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == mid)
            .values(status="sent", provider_message_id=provider_id)
        )
    return mid


def apply_body(backend: Backend, body: str, **kw: object) -> Effect:
    with backend.engine.begin() as conn:
        now = kw.get("now") or read_database_time(conn)
        [done] = apply_events(conn, [parse(body)], now=now)  # type: ignore[arg-type]
    return done.effect


def intake_pass(backend: Backend) -> list[Effect]:
    """An intake pass after the relay saved its send: the deferred events' effects."""
    with backend.engine.begin() as conn:
        return [a.effect for a in apply_deferred(conn, now=read_database_time(conn))]


def suppressed_addresses(backend: Backend) -> list[str]:
    with backend.engine.connect() as conn:
        return sorted(conn.execute(sa.select(suppressions.c.address)).scalars())


def test_a_forged_future_mail_time_never_proves_the_intake_flowed(backend: Backend) -> None:
    """The intake is catching up on a backlog (received now, about mail SES took inside the
    window): by design that proves nothing. Anyone who can publish to the topic adds one
    untagged event (any messageId) stamped 2099: the reconcile must still requeue nothing,
    else the relay sends again and attempt 1's Send event, still in the backlog, shows two
    sends reached SES."""
    mid = held(backend)
    t0 = row(backend.engine, mid).send_started_at
    end = t0 + timedelta(seconds=WINDOW)
    backlog = ses_event("delivery", provider_id="ses-old", mail_at=t0 - timedelta(seconds=5))
    assert apply_body(backend, sns_body(backlog), now=end + timedelta(seconds=1)) is (
        Effect.UNMATCHED
    )
    forged = ses_event("delivery", provider_id=f"forged-{uuid.uuid4()}")
    forged["mail"]["timestamp"] = "2099-01-01T00:00:00.000Z"
    assert apply_body(backend, sns_body(forged), now=end + timedelta(seconds=2)) is (
        Effect.UNMATCHED
    )
    with backend.engine.begin() as conn:
        requeued = store.reconcile_unknown(conn, now=read_database_time(conn), relay_id="r1")
    assert [r.id for r in requeued] == []
    assert row(backend.engine, mid).status == "unknown_outcome"


def test_an_unordered_backlog_never_requeues_a_send_whose_event_is_still_queued(
    backend: Backend,
) -> None:
    """The intake was down past the window. Its queue holds attempt 1's Send event (mail
    taken at t0) and another message's Delivery (mail taken after the window); a standard
    queue gives no order, so the Delivery is received first. A reconcile pass between the two
    batches must not requeue: the next one would have resolved the row."""
    mid = held(backend)
    t0 = row(backend.engine, mid).send_started_at
    token = attempt_rows(backend.engine, mid)[0].claim_token
    end = t0 + timedelta(seconds=WINDOW)
    later = ses_event("delivery", provider_id="ses-other", mail_at=end + timedelta(seconds=1))
    assert apply_body(backend, sns_body(later), now=end + timedelta(seconds=5)) is (
        Effect.UNMATCHED
    )
    with backend.engine.begin() as conn:
        requeued = store.reconcile_unknown(conn, now=read_database_time(conn), relay_id="r1")
    sender = FakeSender()
    relay = relay_for(backend, sender, relay_id="r2")
    with closing(relay):
        settle(relay)
    own = ses_event(
        "send", provider_id="ses-attempt-1", message_id=mid, claim_token=token, mail_at=t0
    )
    late = apply_body(backend, sns_body(own), now=end + timedelta(seconds=6))
    assert ([r.id for r in requeued], sender.called_ids) == ([], [])
    assert late is Effect.RESOLVED


def test_an_event_suppresses_only_its_messages_own_recipients(backend: Backend) -> None:
    """An identity notification carries no tags: it is matched by SES message id alone, which
    every recipient reads in the Message-ID header. A forged complaint for that id listing
    other addresses must not suppress them (one 256 KiB body lists thousands)."""
    mid = sent_row(backend, "0100-known-id")
    complaint = ses_event("notification_complaint", provider_id="0100-known-id")
    complaint["complaint"]["complainedRecipients"] += [
        {"emailAddress": a} for a in ("ceo@example.com", "billing@customer.example")
    ]
    assert apply_body(backend, sns_body(complaint)) is Effect.STATUS
    assert row(backend.engine, mid).delivery_status == "complained"
    assert suppressed_addresses(backend) == ["customer0@example.com"]


def _applying_during_send(
    backend: Backend, kind: str, answer: Callable[[OutgoingMessage], Outcome]
) -> tuple[FakeSender, list[Effect]]:
    """A sender that, while SES "has" the call, lets the intake apply the ``kind`` event of
    this very attempt (its tags, SES message id ``ses-<id>``), then answers ``answer(m)``."""
    seen: list[Effect] = []

    def send(m: OutgoingMessage) -> Outcome:
        event = ses_event(
            kind, provider_id=f"ses-{m.id}", message_id=m.id, claim_token=m.claim_token
        )
        for _ in range(50):  # SQLite: the relay's own write may hold the file; the loop retries
            try:
                seen.append(apply_body(backend, sns_body(event)))
                break
            except sa.exc.OperationalError:
                time.sleep(0.02)
        return answer(m)

    return FakeSender(send), seen


def test_an_event_during_a_hung_send_still_resolves_it(backend: Backend) -> None:
    """A send that hangs past the relay's timeout is the usual ambiguous send, and SES's
    Send/Delivery events for it arrive during the hang. Once the relay parks the row, that
    recorded event must resolve it: today a hold row waits for a human and a reconcile row is
    neither resolved nor (matched) ever requeued."""
    (mid,) = enqueue(backend.engine, 1, outbox=OUTBOX, category="receipts")
    sender, seen = _applying_during_send(
        backend, "delivery", lambda m: Ambiguous(code="ReadTimeout")
    )
    relay = relay_for(backend, sender)
    with closing(relay):
        settle(relay)
        settle(relay)
    assert seen == [Effect.DEFERRED]
    assert intake_pass(backend) == [Effect.RESOLVED]
    after = row(backend.engine, mid)
    assert (after.status, after.delivery_status) == ("sent", "delivered")
    assert after.provider_message_id == f"ses-{mid}"


def test_a_bounce_before_the_send_is_saved_still_sets_delivery_status(backend: Backend) -> None:
    (mid,) = enqueue(backend.engine, 1)
    sender, seen = _applying_during_send(
        backend, "bounce", lambda m: Accepted(provider_message_id=f"ses-{m.id}")
    )
    relay = relay_for(backend, sender)
    with closing(relay):
        settle(relay)
    assert seen == [Effect.DEFERRED]
    assert intake_pass(backend) == [Effect.STATUS]
    after = row(backend.engine, mid)
    assert (after.status, after.provider_message_id) == ("sent", f"ses-{mid}")
    assert after.delivery_status == "bounced"
    assert suppressed_addresses(backend) == ["customer0@example.com"]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mysql"], indirect=True)
def test_a_bounced_address_is_suppressed_whatever_a_lookalike_holds(backend: Backend) -> None:
    sent_row(backend, "ses-1", to="jose@example.com")
    sent_row(backend, "ses-2", to="jose@example.com")
    lookalike = ses_event("notification_complaint", provider_id="ses-1", to="josé@example.com")
    bounce = ses_event("notification_bounce", provider_id="ses-2", to="jose@example.com")
    assert apply_body(backend, sns_body(lookalike)) is Effect.STATUS
    assert apply_body(backend, sns_body(bounce)) is Effect.STATUS
    assert "jose@example.com" in suppressed_addresses(backend)
    (third,) = enqueue(backend.engine, 1, to=["jose@example.com"])
    sender = FakeSender()
    relay = relay_for(backend, sender)
    with closing(relay):
        settle(relay)
    assert sender.called_ids == []
    assert (row(backend.engine, third).status, row(backend.engine, third).last_error_code) == (
        "failed",
        "suppressed",
    )


def test_a_forged_future_event_time_never_hides_the_intakes_lag(backend: Backend) -> None:
    """The intake is an hour behind SES (it received, just now, an event SES published an hour
    ago). One untagged event stamped 2099 must not turn that into a lag of zero."""
    with backend.engine.connect() as conn:
        now = read_database_time(conn)
    behind = ses_event("delivery", provider_id="ses-behind", mail_at=now - timedelta(hours=1))
    forged = ses_event("delivery", provider_id=f"forged-{uuid.uuid4()}")
    forged["mail"]["timestamp"] = "2099-01-01T00:00:00.000Z"
    forged["delivery"]["timestamp"] = "2099-01-01T00:00:01.000Z"
    assert apply_body(backend, sns_body(behind)) is Effect.UNMATCHED
    with backend.engine.connect() as conn:
        honest = _read_intake(conn).lag_seconds
    assert honest is not None
    assert honest > 3000
    assert apply_body(backend, sns_body(forged)) is Effect.UNMATCHED
    with backend.engine.connect() as conn:
        lag = _read_intake(conn).lag_seconds
    assert lag is not None
    assert lag > 3000


@pytest.mark.parametrize("server_backend", ["postgresql", "mysql"], indirect=True)
def test_a_replica_with_an_old_snapshot_still_applies_its_event(server_backend: Backend) -> None:
    """``Intake`` and ``apply_events`` take any engine (only the CLI builds READ COMMITTED;
    the relay warns about REPEATABLE READ, the intake does not). Replica B's batch began
    before replica A resolved the row; B's Bounce for that row must still raise its status."""
    engine = server_backend.engine
    (mid,) = enqueue(engine, 1)
    token = str(uuid.uuid4())
    with engine.begin() as conn:
        conn.execute(
            sa.insert(attempts).values(
                message_id=mid,
                claim_token=token,
                finished_at=read_database_time(conn),
                outcome="ambiguous",
            )
        )
        conn.execute(
            sa.update(messages).where(messages.c.id == mid).values(status="unknown_outcome")
        )

    def event(kind: str, provider_id: str, **tags: object) -> list[SesEvent]:
        return [parse(sns_body(ses_event(kind, provider_id=provider_id, **tags)))]  # type: ignore[arg-type]

    with engine.connect() as b_conn, b_conn.begin():
        now = read_database_time(b_conn)
        apply_events(b_conn, event("delivery", "ses-other"), now=now)  # B's snapshot
        with engine.begin() as a_conn:
            [sent] = apply_events(
                a_conn, event("send", "ses-1", message_id=mid, claim_token=token), now=now
            )
        [bounce] = apply_events(
            b_conn, event("bounce", "ses-1", message_id=mid, claim_token=token), now=now
        )
    assert sent.effect is Effect.RESOLVED
    assert bounce.effect is Effect.STATUS
    assert (row(engine, mid).status, row(engine, mid).delivery_status) == ("sent", "bounced")
