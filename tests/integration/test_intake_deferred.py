"""Events that arrive while their row is being sent, on SQLite, PostgreSQL and MariaDB: recorded
``deferred`` (the relay holds the row and will save what its call returned), then applied by a
later intake pass, once, over whatever the relay saved. Oldest first, a bounded number a pass,
a row still being sent never holding up the others, one replica applying each.

Rows are staged as the relay leaves them (``tests.support.sqs.stage``); the relay's save is a
plain UPDATE of the status, as its finalize would make it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.schema import Status, events, messages
from relay import signals
from relay.events import parse
from relay.intake import Applied, Effect, Intake, apply_deferred, apply_events
from tests.support.db import Backend, attempt_rows, row
from tests.support.sqs import KINDS, ses_event, sns_body, stage

NOW = datetime(2026, 12, 1, 12, 5, tzinfo=UTC)


def arrive(engine: sa.Engine, body: str, *, now: datetime = NOW) -> Applied:
    with engine.begin() as conn:
        [done] = apply_events(conn, [parse(body)], now=now)
    return done


def intake_pass(engine: sa.Engine, **kw: Any) -> list[Applied]:
    with engine.begin() as conn:
        return apply_deferred(conn, now=NOW + timedelta(minutes=1), **kw)


def saved(engine: sa.Engine, mid: int, status: Status, provider_id: str | None = None) -> None:
    """The relay saves what its call returned: the row leaves processing."""
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == mid)
            .values(status=status.value, claim_token=None, provider_message_id=provider_id)
        )


def effect_of(engine: sa.Engine, event_id: int | None) -> str:
    with engine.connect() as conn:
        return str(conn.execute(sa.select(events.c.effect).where(events.c.id == event_id)).scalar())


def being_sent(engine: sa.Engine) -> tuple[int, str]:
    token = str(uuid.uuid4())
    return stage(engine, Status.PROCESSING, tokens=(token,), current=token), token


def test_a_send_event_during_the_call_resolves_the_row_the_call_left_ambiguous(backend: Backend):
    engine = backend.engine
    mid, token = being_sent(engine)
    event = ses_event("send", provider_id="ses-took-it", message_id=mid, claim_token=token)
    done = arrive(engine, sns_body(event))
    assert done.effect is Effect.DEFERRED
    assert effect_of(engine, done.event_id) == "deferred"
    assert intake_pass(engine) == []  # still being sent: left to its relay
    saved(engine, mid, Status.UNKNOWN_OUTCOME)  # the call timed out
    [applied] = intake_pass(engine)
    assert (applied.effect, applied.resolved, applied.event_id) == (
        Effect.RESOLVED,
        True,
        done.event_id,
    )
    after = row(engine, mid)
    assert (after.status, after.provider_message_id) == ("sent", "ses-took-it")
    assert [a.outcome for a in attempt_rows(engine, mid)] == ["ambiguous", "reconciled"]
    assert effect_of(engine, done.event_id) == "resolved"
    assert intake_pass(engine) == []  # applied once
    assert [a.outcome for a in attempt_rows(engine, mid)] == ["ambiguous", "reconciled"]


def test_a_bounce_before_the_relay_saved_the_send_sets_the_delivery_status(backend: Backend):
    """Its suppression is made on arrival (the row's recipients are known while it is being
    sent); its delivery status once the row is sent under the bounce's SES message id."""
    engine = backend.engine
    mid, token = being_sent(engine)
    bounce = ses_event("bounce", provider_id="ses-b", message_id=mid, claim_token=token)
    done = arrive(engine, sns_body(bounce))
    assert (done.effect, done.suppressed) == (Effect.DEFERRED, ("customer0@example.com",))
    saved(engine, mid, Status.SENT, "ses-b")
    assert [a.effect for a in intake_pass(engine)] == [Effect.STATUS]
    assert (row(engine, mid).status, row(engine, mid).delivery_status) == ("sent", "bounced")


def test_an_earlier_attempts_event_during_a_resend_reports_the_duplicate_send(
    backend: Backend, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.WARNING, "relay.intake")
    engine = backend.engine
    first = str(uuid.uuid4())
    second = str(uuid.uuid4())
    mid = stage(engine, Status.PROCESSING, tokens=(first, second), current=second)
    late = ses_event("send", provider_id="ses-first", message_id=mid, claim_token=first)
    assert arrive(engine, sns_body(late)).effect is Effect.DEFERRED
    saved(engine, mid, Status.SENT, "ses-second")
    assert [a.effect for a in intake_pass(engine)] == [Effect.DUPLICATE_SEND]
    assert row(engine, mid).provider_message_id == "ses-second"
    assert "two sends of this message reached SES" in caplog.text


def test_a_pass_takes_the_oldest_first_and_never_waits_on_a_row_still_being_sent(
    backend: Backend,
):
    engine = backend.engine
    stuck, stuck_token = being_sent(engine)
    rows = [being_sent(engine) for _ in range(3)]
    arrive(
        engine,
        sns_body(ses_event("send", provider_id="ses-s", message_id=stuck, claim_token=stuck_token)),
        now=NOW - timedelta(hours=1),
    )
    for n, (mid, token) in enumerate(rows):
        body = sns_body(
            ses_event("send", provider_id=f"ses-{n}", message_id=mid, claim_token=token)
        )
        arrive(engine, body, now=NOW + timedelta(seconds=n))
    for mid, _ in rows:
        saved(engine, mid, Status.UNKNOWN_OUTCOME)
    first = intake_pass(engine, limit=2)
    assert [a.message_id for a in first] == [rows[0][0], rows[1][0]]
    assert [a.message_id for a in intake_pass(engine, limit=2)] == [rows[2][0]]
    assert row(engine, stuck).status == "processing"
    with engine.connect() as conn:
        left = conn.execute(sa.select(events.c.message_id).where(events.c.effect == "deferred"))
        assert list(left.scalars()) == [stuck]


def test_an_intake_pass_applies_the_deferred_events_and_announces_them(backend: Backend):
    engine = backend.engine
    mid, token = being_sent(engine)
    event = ses_event("delivery", provider_id="ses-d", message_id=mid, claim_token=token)
    assert arrive(engine, sns_body(event)).effect is Effect.DEFERRED
    saved(engine, mid, Status.UNKNOWN_OUTCOME)

    class Empty:
        def receive_message(self, **_kw: object) -> dict[str, object]:
            return {}

    intake = Intake(engine=engine, client=Empty(), queue_url="q", wait_seconds=0)
    heard: list[dict[str, Any]] = []

    def on_reconciled(_sender: object, **kw: Any) -> None:
        heard.append(kw)

    signals.reconciled.connect(on_reconciled, sender=intake)
    try:
        assert intake.step() == 0
    finally:
        signals.reconciled.disconnect(on_reconciled, sender=intake)
    assert (row(engine, mid).status, row(engine, mid).delivery_status) == ("sent", "delivered")
    assert intake.counts == {("delivery", "resolved"): 1}
    assert [(h["message_id"], h["result"]) for h in heard] == [(mid, "sent")]


def test_two_replicas_apply_a_deferred_event_once(server_backend: Backend):
    """The second replica's pass waits for the first one's commit, then finds it applied."""
    engine = server_backend.engine
    mid, token = being_sent(engine)
    event = ses_event("send", provider_id="ses-once", message_id=mid, claim_token=token)
    arrive(engine, sns_body(event))
    saved(engine, mid, Status.RETRYING)
    other: list[list[Applied]] = []
    with engine.connect() as a, a.begin():
        mine = apply_deferred(a, now=NOW)
        thread = threading.Thread(target=lambda: other.append(intake_pass(engine)))
        thread.start()
        time.sleep(0.5)  # the other replica's pass is waiting on this one's row lock
        assert not other
    thread.join(10)
    assert [x.effect for x in mine] == [Effect.RESOLVED]
    assert other == [[]]
    assert [a.outcome for a in attempt_rows(engine, mid)] == ["ambiguous", "reconciled"]


# identity notifications carry no tags: nothing names a row being sent (it has no SES id yet)
@pytest.mark.parametrize("kind", sorted(k for k in KINDS if not k.startswith("notification")))
def test_a_deferred_event_means_what_it_meant_on_arrival(backend: Backend, kind: str):
    """Applied from its recorded row, every kind of event leaves the delivery status it leaves
    when it arrives for a sent row: the type and detail stored say all the parser read."""
    engine = backend.engine
    token = str(uuid.uuid4())
    direct = stage(engine, Status.SENT, tokens=(token,), provider_id="ses-a")
    arrive(
        engine, sns_body(ses_event(kind, provider_id="ses-a", message_id=direct, claim_token=token))
    )
    later, later_token = being_sent(engine)
    event = ses_event(kind, provider_id="ses-b", message_id=later, claim_token=later_token)
    assert arrive(engine, sns_body(event)).effect is Effect.DEFERRED
    saved(engine, later, Status.SENT, "ses-b")
    intake_pass(engine)
    assert row(engine, later).delivery_status == row(engine, direct).delivery_status
