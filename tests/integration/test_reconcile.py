"""The reconcile policy: an ambiguous send is held, and requeued once, automatically, only when
the event intake provably flowed past its window without an event for it.

Flowing means outbox_events holds a Send event the intake matched to one of our rows by its
tags, committed (``received_at``, the database's clock) later than the attempt's start plus
``reconcile_after``, about mail SES took (``mail_at``, SES's clock) later than that too. The
events are inserted here directly, with chosen times; what the intake does with a late Send
event after a requeue is the intake's own test. On SQLite, PostgreSQL and MariaDB.
"""

from __future__ import annotations

import math
import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from outbox import AmbiguityPolicy, Category, Outbox
from outbox.schema import attempts, events, intakes, messages
from relay import signals, store
from relay.clock import read_database_time
from relay.senders import Ambiguous
from relay.testing import FakeSender
from tests.support.db import attempt_rows, row
from tests.support.factories import enqueue
from tests.support.hand_clocks import Clock
from tests.support.inprocess import closing, maintain, receiving, relay_for, settle

WINDOW = 60.0
VISIBILITY = 30.0  # seconds: the events queue's visibility timeout
# how long ago the held sends began: every proof a test stamps after their window (up to 40
# days after) lies in the database's past, where a ``caught_up_at`` counts
BACK = timedelta(days=41)
LONG_AGO = datetime(2020, 1, 1, tzinfo=UTC)  # when the intake replicas started
QUEUE = "https://sqs.eu-west-1.amazonaws.com/123456789012/ses-events"
OUTBOX = Outbox(
    categories=[
        Category(name="receipts", ambiguity=AmbiguityPolicy.RECONCILE, reconcile_after=WINDOW),
        Category(name="resent", ambiguity=AmbiguityPolicy.RESEND, max_attempts=1),
    ]
)


def held(backend, category: str = "receipts", count: int = 1) -> list[int]:
    """``count`` messages of ``category`` whose one send was ambiguous: unknown_outcome, with
    the attempt's start kept in ``send_started_at``."""
    ids = enqueue(backend.engine, count, outbox=OUTBOX, category=category)
    relay = relay_for(backend, FakeSender(lambda m: Ambiguous(code="ReadTimeout")))
    with closing(relay):
        settle(relay)
        settle(relay)
    for mid in ids:
        r = row(backend.engine, mid)
        assert (r.status, r.last_error_code) == ("unknown_outcome", "ReadTimeout")
        assert r.send_started_at is not None
    backdate(backend, ids)
    return ids


def backdate(backend, ids: list[int]) -> None:
    """The held sends (and their attempts) began :data:`BACK` ago."""
    with backend.engine.begin() as conn:
        for mid in ids:
            started_at = conn.execute(
                sa.select(messages.c.send_started_at).where(messages.c.id == mid)
            ).scalar_one()
            conn.execute(
                sa.update(messages)
                .where(messages.c.id == mid)
                .values(send_started_at=started_at - BACK)
            )
            conn.execute(
                sa.update(attempts)
                .where(attempts.c.message_id == mid, attempts.c.started_at == started_at)
                .values(started_at=started_at - BACK)
            )


def started(backend, mid: int) -> datetime:
    return row(backend.engine, mid).send_started_at


def event(
    backend,
    *,
    received_at: datetime,
    mail_at: datetime | None,
    message_id: int | None = None,
    effect: str = "unmatched",
    event_type: str = "delivery",
    claim_token: str | None = None,
    intake_id: str | None = "intake-1",
) -> None:
    """An event row as the intake commits it, taken from its queue by replica ``intake_id``
    (the times chosen by the test)."""
    with backend.engine.begin() as conn:
        conn.execute(
            sa.insert(events).values(
                event_key=uuid.uuid4().hex,
                received_at=received_at,
                event_type=event_type,
                event_at=mail_at,
                mail_at=mail_at,
                message_id=message_id,
                tagged_message_id=None if claim_token is None else str(message_id),
                claim_token=claim_token,
                effect=effect,
                source="sns",
                intake_id=intake_id,
            )
        )


def sent_row(backend) -> int:
    """Another message, sent (so no relay of the test sends it)."""
    (other,) = enqueue(backend.engine, 1)
    with backend.engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == other)
            .values(status="sent", provider_message_id=f"ses-{other}")
        )
    return other


def caught_up(
    backend,
    at: datetime | None,
    *,
    visibility: float = VISIBILITY,
    intake_id: str = "intake-1",
    heartbeat_at: datetime | None = None,
    queue_url: str = QUEUE,
) -> None:
    """An intake replica's row in outbox_intakes, as it writes it: it found its queue (whose
    visibility timeout is ``visibility`` seconds) empty at ``at`` (the database's clock),
    its last heartbeat then (or at ``heartbeat_at``)."""
    with backend.engine.begin() as conn:
        conn.execute(sa.delete(intakes).where(intakes.c.intake_id == intake_id))
        conn.execute(
            sa.insert(intakes).values(
                intake_id=intake_id,
                queue_url=queue_url,
                visibility_timeout=visibility,
                started_at=LONG_AGO,
                heartbeat_at=heartbeat_at or at or read_now(backend),
                caught_up_at=at,
            )
        )


def read_now(backend) -> datetime:
    with backend.engine.connect() as conn:
        return read_database_time(conn)


def proof(
    backend,
    *,
    received_at: datetime,
    mail_at: datetime | None,
    drained: bool = True,
    intake_id: str | None = "intake-1",
) -> None:
    """Another message's Send event, matched to it by its tags (the intake's proof that the
    stream which would name an ambiguous send flows), at the given times; with ``drained``,
    an intake then found its queue empty, a second past the visibility timeout."""
    if drained:
        caught_up(backend, received_at + timedelta(seconds=VISIBILITY + 1))
    other = sent_row(backend)
    event(
        backend,
        received_at=received_at,
        mail_at=mail_at,
        message_id=other,
        effect="recorded",
        event_type="send",
        claim_token=str(uuid.uuid4()),
        intake_id=intake_id,
    )


def flowing_past(backend, mid: int, seconds: float = 1.0) -> None:
    """The intake's proof, stamped ``seconds`` past ``mid``'s window on both clocks."""
    after = started(backend, mid) + timedelta(seconds=WINDOW + seconds)
    proof(backend, received_at=after, mail_at=after)


def reconcile(backend, *, now: datetime | None = None, relay_id: str = "r1") -> list[int]:
    with backend.engine.begin() as conn:
        when = now if now is not None else read_database_time(conn)
        return [r.id for r in store.reconcile_unknown(conn, now=when, relay_id=relay_id)]


def outcomes(backend, mid: int) -> list[str]:
    return [a.outcome for a in attempt_rows(backend.engine, mid)]


def test_a_reconcile_row_is_requeued_once_the_intake_flowed_past_its_window(backend):
    (mid,) = held(backend)
    before = row(backend.engine, mid)
    assert before.reconcile_after == WINDOW
    assert before.ambiguity_policy == "hold"  # stored as hold, with its window
    flowing_past(backend, mid)
    with backend.engine.begin() as conn:
        now = read_database_time(conn)
        [done] = store.reconcile_unknown(conn, now=now, relay_id="r1")
    assert (done.id, done.category, done.send_started_at) == (
        mid,
        "receipts",
        before.send_started_at,
    )
    r = row(backend.engine, mid)
    assert (r.status, r.attempt_count, r.next_attempt_at) == ("pending", 0, now)
    assert (r.claim_token, r.lease_expires_at, r.send_started_at) == (None, None, None)
    requeued = attempt_rows(backend.engine, mid)[-1]
    assert (requeued.outcome, requeued.relay_id, requeued.claim_token) == (
        "reconcile:requeued",
        "r1",
        None,
    )
    assert requeued.finished_at == now
    assert reconcile(backend) == []  # nothing left to do


@pytest.mark.parametrize(
    ("received", "mail"),
    [
        (-1.0, -1.0),  # both inside the window
        (WINDOW, WINDOW),  # exactly at its end: not past it
        (+5.0, -1.0),  # committed late, but about mail SES took inside the window (a backlog)
        (-1.0, +5.0),  # SES's clock past, the database's not
        (+5.0, None),  # no mail time: proves nothing about SES's clock
    ],
)
def test_events_not_past_the_window_on_both_clocks_requeue_nothing(backend, received, mail):
    (mid,) = held(backend)
    t0 = started(backend, mid)

    def at(offset: float) -> datetime:
        return t0 + timedelta(seconds=offset if offset == WINDOW else WINDOW + offset)

    proof(backend, received_at=at(received), mail_at=None if mail is None else at(mail))
    assert reconcile(backend) == []
    assert row(backend.engine, mid).status == "unknown_outcome"


@pytest.mark.parametrize(
    ("kind", "matched", "tagged"),
    [
        ("delivery", False, False),  # an identity notification of other mail: no tags
        ("send", False, True),  # another deployment's (or a forged) Send: not our claim token
        ("delivery", True, True),  # our other mail's Delivery: deferred deliveries lag
        ("send", True, False),  # matched by SES message id alone, not by our tags
        ("bounce", True, True),
    ],
)
def test_only_our_own_send_events_prove_the_intake_flowed(backend, kind, matched, tagged):
    (mid,) = held(backend)
    other = sent_row(backend)
    after = started(backend, mid) + timedelta(seconds=WINDOW + 3600)
    event(
        backend,
        received_at=after,
        mail_at=after,
        message_id=other if matched else None,
        effect="recorded" if matched else "unmatched",
        event_type=kind,
        claim_token=str(uuid.uuid4()) if tagged else None,
    )
    assert reconcile(backend) == []
    assert row(backend.engine, mid).status == "unknown_outcome"
    flowing_past(backend, mid)  # the same times, by a matched Send: proof
    assert reconcile(backend) == [mid]


def test_without_an_intake_that_found_its_queue_empty_nothing_is_requeued(backend):
    (mid,) = held(backend)
    after = started(backend, mid) + timedelta(seconds=WINDOW + 3600)
    proof(backend, received_at=after, mail_at=after, drained=False)
    assert reconcile(backend) == []  # no outbox_intakes row at all
    caught_up(backend, None)  # a replica that never found its queue empty
    assert reconcile(backend) == []
    assert row(backend.engine, mid).status == "unknown_outcome"


@pytest.mark.parametrize(
    ("drained", "requeued"),
    [
        (-1.0, False),  # the queue was empty before the proof committed: a backlog since
        (0.0, False),  # empty as the proof committed
        (VISIBILITY - 1, False),  # a message another replica took may still be hidden
        (VISIBILITY, False),  # exactly the visibility timeout later: not past it
        (VISIBILITY + 1, True),
    ],
)
def test_the_proof_counts_once_the_queue_was_found_empty_a_visibility_timeout_later(
    backend, drained, requeued
):
    (mid,) = held(backend)
    after = started(backend, mid) + timedelta(seconds=WINDOW + 5)
    proof(backend, received_at=after, mail_at=after, drained=False)
    caught_up(backend, after + timedelta(seconds=drained))
    assert reconcile(backend) == ([mid] if requeued else [])


def test_every_live_replica_of_the_queue_must_have_found_it_empty(backend):
    """A replica that has not found the queue empty since the proof may hold the row's own
    event in flight: until it does (or is dead), another's empty receive proves nothing."""
    (mid,) = held(backend)
    after = started(backend, mid) + timedelta(seconds=WINDOW + 5)
    proof(backend, received_at=after, mail_at=after, drained=False, intake_id="intake-a")
    caught_up(backend, after - timedelta(seconds=1), intake_id="intake-a")
    assert reconcile(backend) == []
    caught_up(backend, after + timedelta(seconds=VISIBILITY + 1), intake_id="intake-b")
    assert reconcile(backend) == []  # intake-a, alive, last found it empty before the proof
    caught_up(backend, after + timedelta(seconds=VISIBILITY + 1), intake_id="intake-a")
    assert reconcile(backend) == [mid]


@pytest.mark.parametrize(
    ("silent_for", "requeued"),
    [
        (store.RECEIVE_AFTER_HEARTBEAT + VISIBILITY - 1, False),  # may still hold a message
        (store.RECEIVE_AFTER_HEARTBEAT + VISIBILITY + 1, True),  # whatever it took is back
    ],
)
def test_a_dead_replica_no_longer_needs_to_vouch(backend, silent_for, requeued):
    (mid,) = held(backend)
    after = started(backend, mid) + timedelta(seconds=WINDOW + 5)
    proof(backend, received_at=after, mail_at=after, drained=False, intake_id="intake-a")
    empty_at = after + timedelta(seconds=VISIBILITY + 1)
    caught_up(backend, empty_at, intake_id="intake-a")
    caught_up(  # it beat after the proof, then went silent, never finding the queue empty
        backend,
        None,
        intake_id="intake-dead",
        heartbeat_at=empty_at - timedelta(seconds=silent_for),
    )
    assert reconcile(backend) == ([mid] if requeued else [])


def test_replicas_of_another_queue_neither_prove_nor_block(backend):
    (mid,) = held(backend)
    after = started(backend, mid) + timedelta(seconds=WINDOW + 5)
    proof(backend, received_at=after, mail_at=after, drained=False, intake_id="intake-a")
    other = "https://sqs.eu-west-1.amazonaws.com/123456789012/other-events"
    empty_at = after + timedelta(seconds=VISIBILITY + 1)
    caught_up(backend, empty_at, intake_id="intake-b", queue_url=other)
    assert reconcile(backend) == []  # the proof's own queue was never found empty
    caught_up(backend, None, intake_id="intake-c", queue_url=other)  # silent, alive
    caught_up(backend, empty_at, intake_id="intake-a")
    assert reconcile(backend) == [mid]


def test_a_caught_up_at_later_than_the_databases_clock_counts_for_nothing(backend):
    """Written before the database's clock was stepped back: it claims an emptiness seen
    later than now."""
    (mid,) = held(backend)
    after = started(backend, mid) + timedelta(seconds=WINDOW + 5)
    proof(backend, received_at=after, mail_at=after, drained=False)
    caught_up(backend, read_now(backend) + timedelta(hours=1))
    assert reconcile(backend) == []
    caught_up(backend, after + timedelta(seconds=VISIBILITY + 1))
    assert reconcile(backend) == [mid]


def test_an_event_without_its_replica_proves_nothing(backend):
    (mid,) = held(backend)
    after = started(backend, mid) + timedelta(seconds=WINDOW + 5)
    proof(backend, received_at=after, mail_at=after, drained=False, intake_id=None)
    caught_up(backend, after + timedelta(seconds=VISIBILITY + 1))
    assert reconcile(backend) == []


@pytest.mark.parametrize("visibility", [-VISIBILITY, 1e300], ids=["negative", "huge"])
def test_an_intake_row_with_an_unusable_visibility_timeout_proves_nothing(backend, visibility):
    (mid,) = held(backend)
    after = started(backend, mid) + timedelta(seconds=WINDOW + 5)
    proof(backend, received_at=after, mail_at=after, drained=False)
    caught_up(backend, after + timedelta(seconds=1), visibility=visibility)
    assert reconcile(backend) == []
    assert row(backend.engine, mid).status == "unknown_outcome"


def test_without_any_event_nothing_is_ever_requeued(backend):
    (mid,) = held(backend)
    far = started(backend, mid) + timedelta(days=3650)
    assert reconcile(backend, now=far) == []
    assert row(backend.engine, mid).status == "unknown_outcome"


def test_an_event_for_the_row_keeps_it_for_the_intake(backend):
    (mid,) = held(backend)
    event(
        backend,
        received_at=started(backend, mid) + timedelta(seconds=1),
        mail_at=started(backend, mid),
        message_id=mid,
        effect="recorded",
    )
    flowing_past(backend, mid)
    assert reconcile(backend) == []
    assert row(backend.engine, mid).status == "unknown_outcome"


@pytest.mark.parametrize("category", ["default", "resent"])
def test_hold_and_resend_rows_are_never_reconciled(backend, category):
    (mid,) = held(backend, category)  # resend with its one attempt used: held too
    assert row(backend.engine, mid).reconcile_after is None
    flowing_past(backend, mid, seconds=3600)
    assert reconcile(backend) == []
    assert row(backend.engine, mid).status == "unknown_outcome"


def test_a_row_requeued_once_that_comes_back_ambiguous_stays_for_a_human(backend):
    (mid,) = held(backend)
    flowing_past(backend, mid)
    assert reconcile(backend) == [mid]
    sender = FakeSender(lambda m: Ambiguous(code="ReadTimeout"))
    relay = relay_for(backend, sender)
    with closing(relay):
        settle(relay)
        settle(relay)
    assert len(sender.calls) == 1
    assert row(backend.engine, mid).status == "unknown_outcome"
    backdate(backend, [mid])
    flowing_past(backend, mid, seconds=3600)
    assert reconcile(backend) == []
    assert row(backend.engine, mid).status == "unknown_outcome"
    assert outcomes(backend, mid) == ["ambiguous", "reconcile:requeued", "ambiguous"]


def test_a_skewed_relay_clock_cannot_requeue_early(backend):
    """Neither the relay's clock nor the ``now`` it passes decides: a relay whose clock runs
    a day ahead requeues nothing while the database's events stay inside the window, and
    requeues once they are past it."""
    (mid,) = held(backend)
    t0 = started(backend, mid)
    inside = t0 + timedelta(seconds=WINDOW - 1)
    proof(backend, received_at=inside, mail_at=inside)
    ahead = Clock(read_now(backend) + timedelta(days=1))
    sender = FakeSender()
    relay = relay_for(backend, sender, ahead, relay_id="r2")
    with closing(relay), receiving(signals.reconciled, relay) as reconciled:
        maintain(relay)
        assert row(backend.engine, mid).status == "unknown_outcome"
        assert reconcile(backend, now=ahead()) == []
        assert reconciled == []
        flowing_past(backend, mid)
        maintain(relay)
    assert row(backend.engine, mid).status == "pending"
    assert [(r["message_id"], r["result"]) for r in reconciled] == [(mid, "requeued")]


def test_the_relays_sweep_requeues_and_the_next_claim_sends_it_once(backend):
    (mid, other) = held(backend, count=2)
    event(
        backend,
        received_at=started(backend, other),
        mail_at=started(backend, other),
        message_id=other,
        effect="resolved",
    )  # the other one's Send event came (the intake resolves that one)
    flowing_past(backend, mid)
    sender = FakeSender()
    relay = relay_for(backend, sender, relay_id="r2")
    with closing(relay), receiving(signals.reconciled, relay) as reconciled:
        maintain(relay)
        settle(relay)
    assert [(r["message_id"], r["category"], r["result"]) for r in reconciled] == [
        (mid, "receipts", "requeued")
    ]
    assert sender.called_ids == [mid]
    assert row(backend.engine, mid).status == "sent"
    assert row(backend.engine, other).status == "unknown_outcome"
    assert outcomes(backend, mid) == ["ambiguous", "reconcile:requeued", "accepted"]
    [first, _requeued, second] = attempt_rows(backend.engine, mid)
    assert first.claim_token != second.claim_token  # the new attempt has its own tag


def test_two_relays_reconciling_in_turn_requeue_once(backend):
    (mid,) = held(backend)
    flowing_past(backend, mid)
    assert reconcile(backend, relay_id="r1") == [mid]
    assert reconcile(backend, relay_id="r2") == []
    assert outcomes(backend, mid).count("reconcile:requeued") == 1


def test_the_oldest_attempts_go_first_and_a_pass_is_bounded(backend):
    ids = held(backend, count=3)
    flowing_past(backend, ids[-1])
    with backend.engine.begin() as conn:
        now = read_database_time(conn)
        first = store.reconcile_unknown(conn, now=now, relay_id="r1", limit=2)
    assert len(first) == 2
    assert [r.send_started_at for r in first] == sorted(r.send_started_at for r in first)
    assert sorted(reconcile(backend) + [r.id for r in first]) == ids


def test_two_relays_racing_on_stale_reads_requeue_once(server_backend):
    """Both reconciles read the row as requeueable before either writes (no locks: the
    guarded UPDATE alone must hold): one requeues it, the other's UPDATE finds it moved."""
    backend = server_backend
    (mid,) = held(backend)
    flowing_past(backend, mid)
    both_read = threading.Barrier(2, timeout=10)
    results: dict[str, list[store.Reconciled]] = {}
    errors: list[BaseException] = []
    waiting = threading.local()

    def before_update(conn, cursor, statement, *args):
        if statement.lstrip().upper().startswith("UPDATE OUTBOX_MESSAGES") and not getattr(
            waiting, "done", False
        ):
            waiting.done = True
            both_read.wait()

    def run(relay_id: str) -> None:
        try:
            with backend.engine.begin() as conn:
                now = read_database_time(conn)
                results[relay_id] = store.reconcile_unknown(
                    conn, now=now, relay_id=relay_id, lock=False
                )
        except BaseException as exc:
            errors.append(exc)

    sa.event.listen(backend.engine, "before_cursor_execute", before_update)
    try:
        threads = [threading.Thread(target=run, args=(name,)) for name in ("r1", "r2")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        sa.event.remove(backend.engine, "before_cursor_execute", before_update)
    assert errors == []
    assert sorted(len(found) for found in results.values()) == [0, 1]
    assert outcomes(backend, mid).count("reconcile:requeued") == 1
    assert row(backend.engine, mid).status == "pending"


# -- SES answered after all: the held attempt's stale:accepted ---------------------------


def answered(
    backend,
    mid: int,
    provider_id: str,
    *,
    outcome: str = "stale:accepted",
    started_at: datetime | None = None,
) -> None:
    """SES's answer to the held attempt, saved after its claim was gone: an attempt under the
    held attempt's claim token, started when it did (or at ``started_at``)."""
    held_attempt = attempt_rows(backend.engine, mid)[0]
    with backend.engine.begin() as conn:
        conn.execute(
            sa.insert(attempts).values(
                message_id=mid,
                claim_token=held_attempt.claim_token,
                relay_id=held_attempt.relay_id,
                started_at=started_at or started(backend, mid),
                finished_at=read_database_time(conn),
                outcome=outcome,
                provider_message_id=provider_id,
            )
        )


def test_a_held_send_ses_answered_after_all_is_sent_never_requeued(backend):
    (mid,) = held(backend)
    t0 = started(backend, mid)
    answered(backend, mid, "ses-late-1")
    flowing_past(backend, mid, seconds=3600)
    assert reconcile(backend) == []  # the proof is there: SES's answer wins over it
    sender = FakeSender()
    relay = relay_for(backend, sender, relay_id="r2")
    with closing(relay), receiving(signals.reconciled, relay) as reconciled:
        maintain(relay)
        settle(relay)
    assert sender.calls == []
    r = row(backend.engine, mid)
    assert (r.status, r.provider_message_id, r.last_error_code) == ("sent", "ses-late-1", None)
    assert r.sent_at is not None
    assert r.sent_at >= t0
    assert outcomes(backend, mid) == ["ambiguous", "stale:accepted", "reconciled"]
    settled = attempt_rows(backend.engine, mid)[-1]
    assert (settled.relay_id, settled.provider_message_id) == ("r2", "ses-late-1")
    assert settled.claim_token == attempt_rows(backend.engine, mid)[0].claim_token
    assert reconciled == [
        {
            "message_id": mid,
            "category": "receipts",
            "result": "sent",
            "provider_message_id": "ses-late-1",
        }
    ]


def test_two_relays_resolving_in_turn_resolve_once(backend):
    (mid,) = held(backend)
    answered(backend, mid, "ses-late-1")
    with backend.engine.begin() as conn:
        now = read_database_time(conn)
        first = store.resolve_confirmed(conn, now=now, relay_id="r1", lock=False)
        second = store.resolve_confirmed(conn, now=now, relay_id="r2", lock=False)
    assert [(c.id, c.category, c.provider_message_id) for c in first] == [
        (mid, "receipts", "ses-late-1")
    ]
    assert second == []
    assert outcomes(backend, mid).count("reconciled") == 1


def test_an_answer_to_an_earlier_attempt_leaves_the_row_for_a_human(backend):
    """A MessageId from before the held attempt began names an earlier send, not this one:
    the row is not resolved by it, and not requeued either (SES took the message once)."""
    (mid,) = held(backend)
    answered(backend, mid, "ses-earlier", started_at=started(backend, mid) - timedelta(hours=1))
    flowing_past(backend, mid, seconds=3600)
    with backend.engine.begin() as conn:
        now = read_database_time(conn)
        assert store.resolve_confirmed(conn, now=now, relay_id="r1") == []
        assert store.reconcile_unknown(conn, now=now, relay_id="r1") == []
    r = row(backend.engine, mid)
    assert (r.status, r.provider_message_id) == ("unknown_outcome", None)


def test_a_hold_row_ses_answered_is_left_to_its_operator(backend):
    (mid,) = held(backend, "default")
    answered(backend, mid, "ses-late-1")
    with backend.engine.begin() as conn:
        now = read_database_time(conn)
        assert store.resolve_confirmed(conn, now=now, relay_id="r1") == []
    assert row(backend.engine, mid).status == "unknown_outcome"


# -- a row edited in the database --------------------------------------------------------


@pytest.mark.parametrize(
    "edit",
    [
        {"reconcile_after": -WINDOW},  # would end before the send began
        {"reconcile_after": 0.0},
        {"reconcile_after": store.MAX_RECONCILE_AFTER + 1},
        {"reconcile_after": 1e300},  # more than any timestamp can take
        {"send_started_at": datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)},  # overflows
    ],
    ids=["negative", "zero", "over-30-days", "huge", "last-date"],
)
def test_a_row_with_an_unusable_window_stays_for_a_human(backend, edit):
    (mid, edited) = held(backend, count=2)
    with backend.engine.begin() as conn:
        conn.execute(sa.update(messages).where(messages.c.id == edited).values(**edit))
    flowing_past(backend, mid, seconds=40 * 24 * 3600.0)  # past any window of 30 days
    assert reconcile(backend) == [mid]  # the edited row fails nothing
    assert row(backend.engine, edited).status == "unknown_outcome"


@pytest.mark.parametrize("window", [math.inf, math.nan], ids=["inf", "nan"])
def test_an_infinite_or_nan_window_stays_for_a_human(postgres_backend, window):
    """PostgreSQL stores both (NaN compares greater than every number there); MariaDB stores
    neither, SQLite stores NaN as NULL."""
    backend = postgres_backend
    (mid, edited) = held(backend, count=2)
    with backend.engine.begin() as conn:
        conn.execute(
            sa.update(messages).where(messages.c.id == edited).values(reconcile_after=window)
        )
    flowing_past(backend, mid, seconds=3600)
    assert reconcile(backend) == [mid]
    assert row(backend.engine, edited).status == "unknown_outcome"


def test_a_requeue_the_database_refuses_is_rolled_back_alone(server_backend):
    """One row's requeue fails in the database (here its UPDATE is made to store a priority
    out of its column's range): that row stays, the pass requeues the others and commits."""
    backend = server_backend
    ids = held(backend, count=3)
    refused = ids[1]
    flowing_past(backend, ids[-1])

    def refuse(conn, cursor, statement, parameters, context, executemany):
        values = parameters.values() if isinstance(parameters, dict) else parameters
        if statement.lstrip().upper().startswith("UPDATE OUTBOX_MESSAGES") and (
            refused in list(values)
        ):
            table = "outbox_messages"
            statement = f"UPDATE {table} SET priority = 99999999 WHERE id = {refused}"
            return statement, {} if isinstance(parameters, dict) else ()
        return statement, parameters

    sa.event.listen(backend.engine, "before_cursor_execute", refuse, retval=True)
    try:
        done = reconcile(backend)
    finally:
        sa.event.remove(backend.engine, "before_cursor_execute", refuse)
    assert sorted(done) == [ids[0], ids[2]]
    assert row(backend.engine, refused).status == "unknown_outcome"
    assert outcomes(backend, refused) == ["ambiguous"]
    assert reconcile(backend) == [refused]  # nothing refuses it now


# -- the window's start is on the database's clock ----------------------------------------


@pytest.mark.parametrize("skew", [-3600.0, +3600.0], ids=["behind", "ahead"])
def test_a_sends_start_is_never_earlier_than_the_databases_clock(backend, skew):
    """The relay's estimate of the database's clock is an hour off: the row's start, and its
    attempt's, is the database's own reading when the estimate is behind (the window would
    end an hour early), the estimate when it is ahead (the window only ends late)."""
    before = read_now(backend)
    clock = Clock(before + timedelta(seconds=skew))
    (mid,) = enqueue(backend.engine, 1, outbox=OUTBOX, category="receipts")
    with backend.engine.begin() as conn:  # due by the relay's clock too
        conn.execute(
            sa.update(messages).where(messages.c.id == mid).values(next_attempt_at=clock())
        )
    relay = relay_for(backend, FakeSender(lambda m: Ambiguous(code="ReadTimeout")), clock)
    with closing(relay):
        settle(relay)
        settle(relay)
    after = read_now(backend)
    t0 = started(backend, mid)
    if skew < 0:
        assert before <= t0 <= after
    else:
        assert t0 == clock()
    [attempt] = attempt_rows(backend.engine, mid)
    assert (attempt.outcome, attempt.started_at) == ("ambiguous", t0)
