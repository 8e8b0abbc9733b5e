"""Attacks on the send side of delivery truth (suppression at send, the reconcile policy,
resolve): each test states what must hold and fails while the gap it names is open.

The reconcile sweep's proof that the intake "flows" must be proof that the stream which would
name *this* ambiguous send flows: events the intake could have matched to it. Events that
cannot name any ambiguous row (identity notifications carry no tags; another deployment's
events on a shared topic; forged ones) or that not every send produces (a Delivery of other
mail, while the row's own is deferred) prove nothing about it. On SQLite, PostgreSQL and
MariaDB; events go through the intake's parser and ``apply_events``, as the loop applies them.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa

from outbox import AmbiguityPolicy, Category, Outbox
from outbox.schema import attempts, events, intakes, messages
from relay import store
from relay.clock import read_database_time
from relay.events import parse
from relay.intake import MAX_MESSAGES, Effect, Intake, apply_deferred, apply_events
from relay.senders import Accepted, Ambiguous, OutgoingMessage
from relay.senders.ses import build_request
from relay.testing import FakeSender
from tests.support.db import attempt_rows, row
from tests.support.factories import enqueue
from tests.support.hand_clocks import Clock
from tests.support.inprocess import HeldSender, closing, relay_for, settle
from tests.support.sqs import ses_event, sns_body

WINDOW = 60.0
VISIBILITY = 30.0  # seconds: the events queue's visibility timeout
OUTBOX = Outbox(
    categories=[
        Category(name="receipts", ambiguity=AmbiguityPolicy.RECONCILE, reconcile_after=WINDOW)
    ]
)


def held(backend, count: int = 1) -> list[int]:
    """``count`` reconcile-policy messages whose one send was ambiguous (unknown_outcome)."""
    ids = enqueue(backend.engine, count, outbox=OUTBOX, category="receipts")
    relay = relay_for(backend, FakeSender(lambda m: Ambiguous(code="ReadTimeout")))
    with closing(relay):
        settle(relay)
        settle(relay)
    for mid in ids:
        assert row(backend.engine, mid).status == "unknown_outcome"
    with backend.engine.begin() as conn:  # begun a day ago: a proof after it is in the past
        for mid in ids:
            started_at = row(backend.engine, mid).send_started_at
            conn.execute(
                sa.update(messages)
                .where(messages.c.id == mid)
                .values(send_started_at=started_at - timedelta(days=1))
            )
            conn.execute(
                sa.update(attempts)
                .where(attempts.c.message_id == mid, attempts.c.started_at == started_at)
                .values(started_at=started_at - timedelta(days=1))
            )
    return ids


def started(backend, mid: int) -> datetime:
    return row(backend.engine, mid).send_started_at


def apply(backend, body: str, *, now: datetime, intake_id: str | None = None) -> Effect:
    with backend.engine.begin() as conn:
        (done,) = apply_events(conn, [parse(body)], now=now, intake_id=intake_id)
    return done.effect


def intake_pass(backend) -> list[Effect]:
    """An intake pass after the relay saved its send: the deferred events' effects."""
    with backend.engine.begin() as conn:
        return [a.effect for a in apply_deferred(conn, now=read_database_time(conn))]


def reconcile(backend) -> list[int]:
    with backend.engine.begin() as conn:
        now = read_database_time(conn)
        return [r.id for r in store.reconcile_unknown(conn, now=now, relay_id="r1")]


def past_window(backend, mid: int, seconds: float) -> datetime:
    return started(backend, mid) + timedelta(seconds=WINDOW + seconds)


def flowing(backend, mail_at: datetime) -> None:
    """The intake flows as it should: another message is sent and its Send event, tagged
    with that attempt's claim token, about mail SES took at ``mail_at``, is committed a
    second later (both past the window under test), and the intake finds its queue empty
    after the visibility timeout."""
    (other,) = enqueue(backend.engine, 1)
    relay = relay_for(backend, FakeSender(), relay_id="flowing")
    with closing(relay):
        settle(relay)
    sent = row(backend.engine, other)
    assert sent.status == "sent"
    token = attempt_rows(backend.engine, other)[-1].claim_token
    event = ses_event(
        "send",
        provider_id=sent.provider_message_id,
        message_id=other,
        claim_token=token,
        mail_at=mail_at,
    )
    committed = mail_at + timedelta(seconds=1)
    recorded = apply(backend, sns_body(event), now=committed, intake_id="intake-1")
    assert recorded is Effect.RECORDED
    with backend.engine.begin() as conn:
        conn.execute(sa.delete(intakes).where(intakes.c.intake_id == "intake-1"))
        conn.execute(
            sa.insert(intakes).values(
                intake_id="intake-1",
                queue_url="q",
                visibility_timeout=VISIBILITY,
                started_at=committed,
                heartbeat_at=committed + timedelta(seconds=VISIBILITY + 1),
                caught_up_at=committed + timedelta(seconds=VISIBILITY + 1),
            )
        )


# -- the reconcile sweep's "flowing" proof -------------------------------------------------


def test_identity_notifications_never_prove_a_reconcile_row_unsent(backend):
    (mid,) = held(backend)
    t0 = started(backend, mid)
    # SES took the ambiguous send and reported it delivered, as an identity notification
    ours = ses_event(
        "notification_delivery", provider_id="ses-ours", mail_at=t0 + timedelta(seconds=0.2)
    )
    assert apply(backend, sns_body(ours), now=t0 + timedelta(seconds=2)) is Effect.UNMATCHED
    # ... and later mail's notifications keep arriving
    later = past_window(backend, mid, 5)
    other = ses_event("notification_delivery", provider_id="ses-other", mail_at=later)
    apply(backend, sns_body(other), now=later + timedelta(seconds=1))
    assert reconcile(backend) == []  # was: [mid], and the next claim mails it a second time
    assert row(backend.engine, mid).status == "unknown_outcome"


def test_another_deployments_events_never_prove_a_reconcile_row_unsent(backend):
    (mid,) = held(backend)
    later = past_window(backend, mid, 5)
    theirs = ses_event(
        "send",
        provider_id="ses-theirs",
        message_id=mid,  # their row ids overlap ours; their claim tokens never do
        claim_token=str(uuid.uuid4()),
        mail_at=later,
    )
    assert apply(backend, sns_body(theirs), now=later + timedelta(seconds=1)) is Effect.UNMATCHED
    assert reconcile(backend) == []  # was: [mid]
    assert row(backend.engine, mid).status == "unknown_outcome"


def test_a_delivery_of_other_mail_never_proves_a_reconcile_row_unsent(backend):
    (mid,) = held(backend)
    (other,) = enqueue(backend.engine, 1, outbox=OUTBOX, category="receipts")
    relay = relay_for(backend, FakeSender(), relay_id="r2")
    with closing(relay):
        settle(relay)
    sent = row(backend.engine, other)
    assert sent.status == "sent"
    token = attempt_rows(backend.engine, other)[-1].claim_token
    later = past_window(backend, mid, 5)
    delivered = ses_event(
        "delivery",
        provider_id=sent.provider_message_id,
        message_id=other,
        claim_token=token,
        mail_at=later,
    )
    assert apply(backend, sns_body(delivered), now=later + timedelta(seconds=1)) is Effect.STATUS
    assert reconcile(backend) == []  # was: [mid]
    assert row(backend.engine, mid).status == "unknown_outcome"


def test_a_send_ses_confirmed_after_the_sweep_is_never_requeued(backend):
    (mid,) = enqueue(backend.engine, 1, outbox=OUTBOX, category="receipts")
    clock = Clock()
    release = threading.Event()

    def slow(message: OutgoingMessage):
        release.wait(10)
        return Accepted(provider_message_id="ses-late-1")

    first = relay_for(backend, FakeSender(slow), clock, relay_id="first")
    with closing(first):
        first.step()  # claimed, marked, the send in flight
        assert first.in_flight == 1
        clock.advance(60)  # its lease (5 s) ran out while the process was frozen
        sweeper_clock = Clock(clock.now)
        second = relay_for(backend, FakeSender(), sweeper_clock, relay_id="second")
        with closing(second):
            second.step()  # the sweep: send started, lease gone -> unknown_outcome
        assert row(backend.engine, mid).status == "unknown_outcome"
        release.set()
        deadline = time.monotonic() + 5
        while first.in_flight and time.monotonic() < deadline:
            first.finalize()
            time.sleep(0.01)
    assert [(a.outcome, a.provider_message_id) for a in attempt_rows(backend.engine, mid)] == [
        ("lease_expired", None),
        ("stale:accepted", "ses-late-1"),
    ]
    flowing(backend, past_window(backend, mid, 5))
    assert mid not in reconcile(backend)  # was requeued: SES had said it took the send
    # the flowing relay's sweep settled it with SES's own answer
    assert (row(backend.engine, mid).status, row(backend.engine, mid).provider_message_id) == (
        "sent",
        "ses-late-1",
    )


def test_a_relay_clock_behind_the_database_cannot_requeue_early(backend):
    with backend.engine.connect() as conn:
        db_now = read_database_time(conn)
    behind = Clock(db_now - timedelta(seconds=WINDOW + 600))
    (mid,) = enqueue(backend.engine, 1, outbox=OUTBOX, category="receipts")
    with backend.engine.begin() as conn:  # due by the relay's clock too
        conn.execute(
            sa.update(messages).where(messages.c.id == mid).values(next_attempt_at=behind())
        )
    relay = relay_for(backend, FakeSender(lambda m: Ambiguous(code="ReadTimeout")), behind)
    with closing(relay):
        settle(relay)
        settle(relay)
    assert row(backend.engine, mid).status == "unknown_outcome"
    # seconds later (real time), the intake commits a Send event of mail SES took just now
    with backend.engine.connect() as conn:
        db_now = read_database_time(conn)
    flowing(backend, db_now)
    assert reconcile(backend) == []  # was: [mid], well inside the row's real window
    assert row(backend.engine, mid).status == "unknown_outcome"


def test_a_second_send_after_a_requeue_is_reported_as_a_duplicate(backend):
    (mid,) = held(backend)
    first = attempt_rows(backend.engine, mid)[-1]
    flowing(backend, past_window(backend, mid, 5))
    assert reconcile(backend) == [mid]
    sender = HeldSender()
    gate = sender.hold(mid)
    relay = relay_for(backend, sender, relay_id="r3")
    with closing(relay):
        relay.step()  # claimed, marked: the second send is in flight
        assert relay.in_flight == 1
        late = ses_event(
            "send",
            provider_id="ses-first",
            message_id=mid,
            claim_token=first.claim_token,
            mail_at=first.started_at,
        )
        assert apply(backend, sns_body(late), now=past_window(backend, mid, 30)) is (
            Effect.DEFERRED
        )
        gate.set()
        settle(relay)
    assert intake_pass(backend) == [Effect.DUPLICATE_SEND]
    after = row(backend.engine, mid)
    assert after.status == "sent"
    assert after.provider_message_id != "ses-first"  # SES took two sends of the message
    with backend.engine.connect() as conn:
        effects = list(
            conn.execute(sa.select(events.c.effect).where(events.c.message_id == mid)).scalars()
        )
    assert "duplicate_send" in effects  # was: ["recorded"]: the double send is never reported


@pytest.mark.parametrize("category", ["default", "receipts"])
def test_an_event_that_came_during_the_send_resolves_its_ambiguous_outcome(backend, category):
    (mid,) = enqueue(backend.engine, 1, outbox=OUTBOX, category=category)
    sender = HeldSender(answer=lambda m: Ambiguous(code="ReadTimeoutError"))
    gate = sender.hold(mid)
    relay = relay_for(backend, sender)
    with closing(relay):
        relay.step()  # claimed, marked: the call is waiting for SES's answer
        assert relay.in_flight == 1
        claimed = row(backend.engine, mid)
        event = ses_event(
            "send",
            provider_id="ses-took-it",
            message_id=mid,
            claim_token=claimed.claim_token,
            mail_at=claimed.send_started_at,
        )
        assert apply(backend, sns_body(event), now=claimed.send_started_at) is Effect.DEFERRED
        gate.set()  # ... and then the read times out
        settle(relay)
    assert intake_pass(backend) == [Effect.RESOLVED]
    reconcile(backend)  # a sweep, at the latest, could settle it from the recorded event
    after = row(backend.engine, mid)
    assert (after.status, after.provider_message_id) == ("sent", "ses-took-it")
    # was: unknown_outcome with no provider id, the proof unused in outbox_events


class ScriptedQueue:
    """An SQS client whose receives return the given batches of bodies in turn (SQS standard
    queues deliver a backlog in no particular order), then nothing."""

    def __init__(self, *batches: list[str]) -> None:
        self.batches = list(batches)

    def receive_message(self, **_kw: object) -> dict[str, object]:
        if not self.batches:
            return {}
        bodies = self.batches.pop(0)
        return {"Messages": [{"Body": b, "ReceiptHandle": f"h{n}"} for n, b in enumerate(bodies)]}

    def delete_message_batch(self, **_kw: object) -> dict[str, object]:
        return {}

    def get_queue_attributes(self, **_kw: object) -> dict[str, object]:
        return {"Attributes": {"VisibilityTimeout": "0"}}


def test_an_intake_catching_up_on_a_backlog_never_gets_a_row_sent_twice(backend):
    window = 1.0
    quick = Outbox(
        categories=[
            Category(name="quick", ambiguity=AmbiguityPolicy.RECONCILE, reconcile_after=window)
        ]
    )
    (mid,) = enqueue(backend.engine, 1, outbox=quick, category="quick")
    relay = relay_for(backend, FakeSender(lambda m: Ambiguous(code="ReadTimeout")))
    with closing(relay):
        settle(relay)
        settle(relay)
    held_row = row(backend.engine, mid)
    assert held_row.status == "unknown_outcome"
    token = attempt_rows(backend.engine, mid)[-1].claim_token
    ours = ses_event(
        "send",
        provider_id="ses-first",
        message_id=mid,
        claim_token=token,
        mail_at=held_row.send_started_at,
    )
    # the intake was down; mail sent after the window waits in the queue with the row's event
    others = enqueue(backend.engine, MAX_MESSAGES)
    relay = relay_for(backend, FakeSender(), relay_id="r2")
    with closing(relay):
        settle(relay)
    later = held_row.send_started_at + timedelta(seconds=window + 5)
    newer = [
        sns_body(
            ses_event(
                "send",
                provider_id=row(backend.engine, o).provider_message_id,
                message_id=o,
                claim_token=attempt_rows(backend.engine, o)[-1].claim_token,
                mail_at=later,
            )
        )
        for o in others
    ]
    with backend.engine.begin() as conn:  # the queue was last found empty before the outage
        conn.execute(
            sa.insert(intakes).values(
                intake_id="before-the-outage",
                queue_url="q",
                visibility_timeout=0.0,
                started_at=held_row.send_started_at,
                heartbeat_at=held_row.send_started_at,
                caught_up_at=held_row.send_started_at,
            )
        )
    time.sleep(window + 0.1)  # the intake comes back after the window
    intake = Intake(
        engine=backend.engine, client=ScriptedQueue(newer, [sns_body(ours)]), queue_url="q"
    )
    intake.check_queue()  # its own row on queue q: the proof events name a replica of q
    assert intake.step() == MAX_MESSAGES  # a full batch: more is waiting
    reconcile(backend)  # a relay's sweep runs between two of the intake's batches
    second = FakeSender()
    relay = relay_for(backend, second, relay_id="r3")
    with closing(relay):
        settle(relay)
    assert intake.step() == 1  # the row's own Send event, SES's proof it took the first send
    assert [m.id for m in second.calls].count(mid) == 0  # was: sent again
    assert row(backend.engine, mid).provider_message_id == "ses-first"


# -- tags --------------------------------------------------------------------------------


def test_mail_stored_with_its_own_outbox_attempt_tag_is_still_sent(backend):
    (mid,) = enqueue(backend.engine, 1, tags={"campaign": "spring"})
    with backend.engine.begin() as conn:
        payload = dict(row(backend.engine, mid, payload=True).payload)
        payload["tags"] = {**payload["tags"], "outbox_attempt": "theirs"}  # before it was ours
        conn.execute(sa.update(messages).where(messages.c.id == mid).values(payload=payload))
    sender = FakeSender()
    relay = relay_for(backend, sender)
    with closing(relay):
        settle(relay)
    after = row(backend.engine, mid)
    assert (after.status, after.last_error_code) == ("sent", None)  # was: failed invalid_payload
    request = build_request(sender.calls[0])
    tags = {t["Name"]: t["Value"] for t in request["EmailTags"]}
    assert tags["outbox_attempt"] == sender.calls[0].claim_token


# -- a row edited in the database ---------------------------------------------------------


@pytest.mark.parametrize("window", [1e300, float("nan")], ids=["huge", "nan"])
def test_one_unusable_window_does_not_stop_reconciling_the_others(postgres_backend, window):
    backend = postgres_backend
    (mid, poisoned) = held(backend, count=2)
    with backend.engine.begin() as conn:
        conn.execute(
            sa.update(messages).where(messages.c.id == poisoned).values(reconcile_after=window)
        )
    flowing(backend, past_window(backend, mid, 5))
    assert reconcile(backend) == [mid]
