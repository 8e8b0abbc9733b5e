"""relay.intake's effects on SQLite, PostgreSQL and MariaDB: what one SES event does to its row,
its event record and the suppression list, and that a replay, a duplicate or an event in the
wrong order changes nothing wrongly.

Events are AWS's documented examples (``tests/fixtures/ses_events``) with the test's ids and
tags put in, read by the intake's own parser, and applied with ``apply_events`` in one
transaction the way the loop does. Rows are staged with plain UPDATEs and attempt rows, as the
relay would have left them.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.schema import Status, attempts, events, messages, suppressions
from relay import intake, signals
from relay.db import make_engine
from relay.events import SesEvent, parse
from relay.intake import Effect, apply_events
from tests.support.db import Backend, attempt_rows, row
from tests.support.factories import enqueue
from tests.support.sqs import MAIL_AT, raw_body, ses_event, sns_body, stage
from tests.support.waiting import wait_for

NOW = datetime(2026, 12, 1, 12, 5, tzinfo=UTC)  # the database's clock, as the loop passes it


def apply(engine: sa.Engine, *bodies: str, now: datetime = NOW) -> list[intake.Applied]:
    with engine.begin() as conn:
        return apply_events(conn, [parse(b) for b in bodies], now=now)


def effects(applied: list[intake.Applied]) -> list[str]:
    return [a.effect.value for a in applied]


def event_rows(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(events).order_by(events.c.id)))


def suppressed(engine: sa.Engine) -> dict[str, sa.Row[Any]]:
    with engine.connect() as conn:
        return {r.address: r for r in conn.execute(sa.select(suppressions))}


def everything(engine: sa.Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row the intake can write, for before/after comparisons."""
    with engine.connect() as conn:
        return {
            t.name.removeprefix("outbox_"): [
                tuple(r) for r in conn.execute(sa.select(t).order_by(*t.primary_key))
            ]
            for t in (messages, attempts, events, suppressions)
        }


@pytest.fixture
def heard() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """The intake's signals, as (name, keyword arguments)."""
    got: list[tuple[str, dict[str, Any]]] = []
    receivers = []
    for signal in (signals.reconciled, signals.delivered, signals.bounced, signals.complained):

        def receive(_sender: Any, _name: str = signal.name, **kw: Any) -> None:
            got.append((_name, kw))

        signal.connect(receive)
        receivers.append((signal, receive))
    yield got
    for signal, receive in receivers:
        signal.disconnect(receive)


# -- resolving -------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [Status.UNKNOWN_OUTCOME, Status.PENDING, Status.RETRYING])
def test_an_event_for_one_of_the_rows_attempts_makes_it_sent(backend: Backend, status, heard):
    engine = backend.engine
    token = str(uuid.uuid4())
    mid = stage(engine, status, tokens=(token,))
    (done,) = apply(
        engine,
        sns_body(
            ses_event(
                "send", provider_id="ses-1", message_id=mid, claim_token=token, mail_at=MAIL_AT
            )
        ),
    )
    intake.announce("intake", [done])

    assert done.effect is Effect.RESOLVED
    assert done.resolved
    assert done.message_id == mid
    after = row(engine, mid)
    assert after.status == "sent"
    assert after.provider_message_id == "ses-1"
    assert after.sent_at == MAIL_AT
    assert (after.claim_token, after.last_error_code) == (None, None)
    assert after.delivery_status is None  # a Send says nothing of delivery
    reconciled = [a for a in attempt_rows(engine, mid) if a.outcome == "reconciled"]
    assert [
        (a.claim_token, a.provider_message_id, a.relay_id, a.finished_at) for a in reconciled
    ] == [(token, "ses-1", "ses-events", NOW)]
    (recorded,) = event_rows(engine)
    assert (recorded.effect, recorded.message_id, recorded.received_at) == ("resolved", mid, NOW)
    assert (recorded.event_type, recorded.mail_at, recorded.claim_token) == ("send", MAIL_AT, token)
    assert heard == [
        (
            "relay.reconciled",
            {
                "message_id": mid,
                "category": "default",
                "provider_message_id": "ses-1",
                "result": "sent",
            },
        )
    ]


def test_the_rows_current_claim_token_matches_too(backend: Backend):
    """The tag's token is the row's current claim token, not yet on any attempt row (the
    relay lost its lease before it could write the attempt): the event is still ours."""
    engine = backend.engine
    token = str(uuid.uuid4())
    mid = stage(engine, Status.UNKNOWN_OUTCOME, current=token)
    (done,) = apply(
        engine,
        sns_body(ses_event("delivery", provider_id="ses-2", message_id=mid, claim_token=token)),
    )
    assert done.effect is Effect.RESOLVED
    after = row(engine, mid)
    assert (after.status, after.delivery_status) == ("sent", "delivered")


def test_a_row_being_sent_is_never_touched(backend: Backend, caplog):
    caplog.set_level(logging.INFO, "relay.intake")
    engine = backend.engine
    token = str(uuid.uuid4())
    mid = stage(engine, Status.PROCESSING, current=token)
    before = everything(engine)
    (done,) = apply(
        engine,
        sns_body(ses_event("delivery", provider_id="ses-3", message_id=mid, claim_token=token)),
    )
    assert done.effect is Effect.DEFERRED
    assert not done.resolved
    after = everything(engine)
    assert after["messages"] == before["messages"]
    assert after["attempts"] == before["attempts"]
    assert [r.effect for r in event_rows(engine)] == ["deferred"]
    assert "being sent" in caplog.text
    with engine.begin() as conn:  # its relay still holds it: a pass leaves it deferred
        assert intake.apply_deferred(conn, now=NOW) == []
    assert [r.effect for r in event_rows(engine)] == ["deferred"]


# -- delivery status ----------------------------------------------------------------------


ORDER = ["delivery_delay", "delivery", "bounce", "complaint"]  # rising rank


@pytest.mark.parametrize(
    "order",
    [ORDER, ORDER[::-1], ["bounce", "delivery", "complaint", "delivery_delay"]],
    ids=["rising", "falling", "mixed"],
)
def test_delivery_status_only_rises_whatever_the_order(backend: Backend, order):
    engine = backend.engine
    token = str(uuid.uuid4())
    mid = stage(engine, Status.SENT, tokens=(token,), provider_id="ses-4")
    base = MAIL_AT + timedelta(minutes=1)
    seen = []
    for kind in order:
        event = ses_event(
            kind,
            provider_id="ses-4",
            message_id=mid,
            claim_token=token,
            at=base + timedelta(seconds=ORDER.index(kind)),
        )
        (done,) = apply(engine, sns_body(event))
        seen.append(done.effect)
    after = row(engine, mid)
    assert after.delivery_status == "complained"
    assert after.delivery_status_at == base + timedelta(seconds=3)
    assert after.status == "sent"
    assert after.provider_message_id == "ses-4"
    # each event rose the status exactly when it outranked every one before it
    ranks = [ORDER.index(k) for k in order]
    expected = [
        Effect.STATUS if r > max(ranks[:i], default=-1) else Effect.RECORDED
        for i, r in enumerate(ranks)
    ]
    assert seen == expected


def test_delivery_before_send_converges(backend: Backend, heard):
    """Out of order: the Delivery resolves the ambiguous row; the Send after it is recorded
    and changes nothing; the row ends as if they had come in order."""
    engine = backend.engine
    token = str(uuid.uuid4())
    mid = stage(engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
    send = ses_event(
        "send", provider_id="ses-5", message_id=mid, claim_token=token, mail_at=MAIL_AT
    )
    delivery = ses_event(
        "delivery", provider_id="ses-5", message_id=mid, claim_token=token, mail_at=MAIL_AT
    )
    first = apply(engine, sns_body(delivery))
    second = apply(engine, sns_body(send))
    intake.announce("intake", [*first, *second])
    assert effects(first + second) == ["resolved", "recorded"]
    after = row(engine, mid)
    assert (after.status, after.provider_message_id, after.sent_at) == ("sent", "ses-5", MAIL_AT)
    assert after.delivery_status == "delivered"
    assert [a.outcome for a in attempt_rows(engine, mid)] == ["ambiguous", "reconciled"]
    assert [name for name, _ in heard] == ["relay.reconciled", "relay.delivered"]
    delivered = heard[1][1]
    assert delivered["recipients"] == ("customer0@example.com",)
    assert delivered["event_at"] == MAIL_AT + timedelta(seconds=1)


# -- duplicates and replays -------------------------------------------------------------


def test_a_replay_changes_nothing(backend: Backend, heard):
    engine = backend.engine
    token = str(uuid.uuid4())
    mid = stage(engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
    batch = [
        ses_event(kind, provider_id="ses-6", message_id=mid, claim_token=token)
        for kind in ("send", "delivery", "bounce")
    ]
    first = apply(engine, *[sns_body(e) for e in batch])
    assert sorted(effects(first)).count("resolved") == 1  # the first applied, in key order
    assert (row(engine, mid).status, row(engine, mid).delivery_status) == ("sent", "bounced")
    before = everything(engine)
    # SNS publishing again (a new envelope), raw delivery, and the same bodies again
    again = apply(engine, *[sns_body(e) for e in batch], *[raw_body(e) for e in batch])
    assert effects(again) == ["duplicate"] * 6
    assert all(a.delete for a in again)
    intake.announce("intake", again)
    assert everything(engine) == before
    assert heard == []


def test_one_event_twice_in_a_batch_counts_once(backend: Backend):
    engine = backend.engine
    token = str(uuid.uuid4())
    mid = stage(engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
    event = ses_event("send", provider_id="ses-7", message_id=mid, claim_token=token)
    done = apply(engine, sns_body(event), sns_body(event))
    assert effects(done) == ["resolved", "duplicate"]
    assert len(event_rows(engine)) == 1
    assert [a.outcome for a in attempt_rows(engine, mid)] == ["ambiguous", "reconciled"]


# -- events that are not ours ---------------------------------------------------------------


def test_an_event_for_a_pruned_row_is_recorded_unmatched(backend: Backend):
    engine = backend.engine
    (done,) = apply(
        engine,
        sns_body(
            ses_event("delivery", provider_id="ses-8", message_id=987654, claim_token="t" * 36)
        ),
    )
    assert done.effect is Effect.UNMATCHED
    assert done.delete
    assert done.message_id is None
    (recorded,) = event_rows(engine)
    assert (recorded.effect, recorded.message_id, recorded.tagged_message_id) == (
        "unmatched",
        None,
        "987654",
    )


def test_another_apps_message_is_recorded_unmatched(backend: Backend):
    engine = backend.engine
    mid = stage(engine, Status.SENT, provider_id="ses-ours")
    before = everything(engine)
    # an identity notification (no tags) and a tagged event of another app's own tags
    foreign = ses_event("notification_bounce", provider_id="ses-theirs", to="jane@example.com")
    tagged = ses_event("bounce", provider_id="ses-theirs-2")
    done = apply(engine, sns_body(foreign), sns_body(tagged))
    assert effects(done) == ["unmatched", "unmatched"]
    after = everything(engine)
    assert after["messages"] == before["messages"]
    assert after["suppressions"] == []
    assert row(engine, mid).delivery_status is None


@pytest.mark.parametrize("tag", ["other-token", None], ids=["wrong-token", "no-token"])
def test_a_tag_with_the_wrong_claim_token_changes_nothing(backend: Backend, tag):
    """The tag names our row, but none of its attempts carries the token (another deployment
    with the same ids, or a forged event): nothing changes. Without the attempt tag the SES
    message id decides, and this one is not ours either."""
    engine = backend.engine
    mid = stage(engine, Status.UNKNOWN_OUTCOME, tokens=(str(uuid.uuid4()),))
    before = everything(engine)
    (done,) = apply(
        engine, sns_body(ses_event("bounce", provider_id="ses-9", message_id=mid, claim_token=tag))
    )
    assert done.effect is Effect.UNMATCHED
    after = everything(engine)
    assert {k: v for k, v in after.items() if k != "events"} == {
        k: v for k, v in before.items() if k != "events"
    }


@pytest.mark.parametrize("tagged", ["12abc", "-1", "99999999999999999999999", "٣"])
def test_a_tag_that_cannot_name_a_row_is_unmatched(backend: Backend, tagged):
    (done,) = apply(
        backend.engine,
        sns_body(ses_event("send", provider_id="ses-10", message_id=tagged, claim_token="t")),
    )
    assert done.effect is Effect.UNMATCHED


# -- matching by SES message id ---------------------------------------------------------


def test_an_identity_notification_finds_its_row_by_ses_message_id(backend: Backend, heard):
    engine = backend.engine
    mid = stage(engine, Status.SENT, provider_id="ses-11", to="jane@example.com")
    (done,) = apply(
        engine,
        sns_body(ses_event("notification_bounce", provider_id="ses-11", to="jane@example.com")),
    )
    intake.announce("intake", [done])
    assert done.effect is Effect.STATUS
    assert done.suppressed == ("jane@example.com",)
    assert row(engine, mid).delivery_status == "bounced"
    ((name, kw),) = heard
    assert name == "relay.bounced"
    assert (kw["bounce_type"], kw["bounce_subtype"]) == ("Permanent", "General")
    assert kw["recipients"] == ("jane@example.com",)


def test_an_attempts_ses_message_id_resolves_its_row(backend: Backend):
    """A stale finalize recorded SES's answer on the attempt only; the row waits in
    unknown_outcome. An identity notification for that SES message id resolves it."""
    engine = backend.engine
    mid = stage(
        engine, Status.UNKNOWN_OUTCOME, tokens=(str(uuid.uuid4()),), attempt_ids=("ses-12",)
    )
    (done,) = apply(engine, sns_body(ses_event("notification_delivery", provider_id="ses-12")))
    assert done.effect is Effect.RESOLVED
    after = row(engine, mid)
    assert (after.status, after.provider_message_id, after.delivery_status) == (
        "sent",
        "ses-12",
        "delivered",
    )


def test_an_event_of_a_second_send_is_a_duplicate_send(backend: Backend, caplog):
    """The row was resent (policy resend) and is sent as ses-b; the first, ambiguous attempt
    reached SES as ses-a after all: two sends reached SES. Recorded, the row is left as it
    is, and a warning says so."""
    engine = backend.engine
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    mid = stage(
        engine,
        Status.SENT,
        tokens=(first, second),
        provider_id="ses-b",
        attempt_ids=(None, "ses-b"),
    )
    before = everything(engine)
    (done,) = apply(
        engine,
        sns_body(ses_event("delivery", provider_id="ses-a", message_id=mid, claim_token=first)),
    )
    assert done.effect is Effect.DUPLICATE_SEND
    assert everything(engine)["messages"] == before["messages"]
    assert [r.effect for r in event_rows(engine)] == ["duplicate_send"]
    assert "two sends" in caplog.text


@pytest.mark.parametrize("status", [Status.FAILED, Status.CANCELLED, Status.EXPIRED])
def test_a_finished_unsent_row_is_recorded_only(backend: Backend, status):
    engine = backend.engine
    token = str(uuid.uuid4())
    mid = stage(engine, status, tokens=(token,))
    before = everything(engine)
    (done,) = apply(
        engine,
        sns_body(ses_event("delivery", provider_id="ses-13", message_id=mid, claim_token=token)),
    )
    assert done.effect is Effect.RECORDED
    assert everything(engine)["messages"] == before["messages"]


# -- suppressions -------------------------------------------------------------------------


def test_permanent_bounces_and_complaints_suppress_their_addresses(backend: Backend):
    engine = backend.engine
    token = str(uuid.uuid4())
    to = ("gone@example.com", "angry@example.com", "full@example.com", "kept@example.com")
    mid = stage(engine, Status.SENT, tokens=(token,), provider_id="ses-14", to=to)
    with engine.begin() as conn:
        conn.execute(
            sa.insert(suppressions).values(
                address="kept@example.com",
                reason="manual",
                detail="by hand",
                created_at=MAIL_AT,
                actor="ops",
            )
        )
    bodies = [
        sns_body(ses_event(kind, provider_id="ses-14", message_id=mid, claim_token=token, to=to))
        for kind, to in [
            ("bounce", "gone@example.com"),
            ("complaint", "angry@example.com"),
            ("bounce_transient", "full@example.com"),
            ("bounce", "kept@example.com"),
        ]
    ]
    done = apply(engine, *bodies)
    assert [a.suppressed for a in done] == [("gone@example.com",), ("angry@example.com",), (), ()]
    found = suppressed(engine)
    assert set(found) == {"gone@example.com", "angry@example.com", "kept@example.com"}
    ids = {a.event.type.value: a.event_id for a in done[:2]}
    gone, angry, kept = (
        found["gone@example.com"],
        found["angry@example.com"],
        found["kept@example.com"],
    )
    assert (gone.reason, gone.detail, gone.event_id, gone.actor, gone.created_at) == (
        "bounce",
        "Permanent/General",
        ids["bounce"],
        "ses-events",
        NOW,
    )
    assert (angry.reason, angry.detail, angry.event_id) == ("complaint", "abuse", ids["complaint"])
    assert (kept.reason, kept.actor, kept.event_id) == ("manual", "ops", None)


def test_an_event_suppresses_only_addresses_its_message_was_sent_to(backend: Backend):
    """To, Cc and Bcc, by addr-spec (display name and case aside); an address the complaint
    adds, and any address of an event matched to no row, stay mailable."""
    engine = backend.engine
    (mid,) = enqueue(
        engine,
        1,
        to=["Jane Doe <Jane@Example.com>"],
        cc=["cc@example.com"],
        bcc=["hidden@example.com"],
    )
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == mid)
            .values(status="sent", provider_message_id="ses-own")
        )
    complaint = ses_event("notification_complaint", provider_id="ses-own", to="jane@example.com")
    complaint["complaint"]["complainedRecipients"] += [
        {"emailAddress": a}
        for a in ("CC@example.com", "hidden@example.com", "stranger@example.com")
    ]
    stray = ses_event("notification_bounce", provider_id="ses-nobody", to="other@example.com")
    done = apply(engine, sns_body(complaint), sns_body(stray))
    assert effects(done) == ["status", "unmatched"]
    assert done[0].suppressed == ("cc@example.com", "hidden@example.com", "jane@example.com")
    assert done[1].suppressed == ()
    assert sorted(suppressed(engine)) == [
        "cc@example.com",
        "hidden@example.com",
        "jane@example.com",
    ]


# -- malformed ------------------------------------------------------------------------------


def test_a_malformed_message_is_recorded_once_and_kept_on_the_queue(backend: Backend):
    engine = backend.engine
    first = apply(engine, "{not json")
    again = apply(engine, "{not json", "{not json")
    assert effects(first) == ["malformed"]
    assert effects(again) == ["duplicate", "duplicate"]
    assert not any(a.delete for a in first + again)  # SQS counts its receives: DLQ after 3
    (recorded,) = event_rows(engine)
    assert (recorded.effect, recorded.event_type, recorded.message_id) == (
        "malformed",
        "malformed",
        None,
    )
    assert recorded.error


# -- the database deciding ------------------------------------------------------------------


def test_an_event_the_database_refuses_is_left_on_the_queue_alone(server_backend: Backend):
    """A value the database will not store (here a key longer than its column) rolls back
    that event only; the batch's other events commit."""
    engine = server_backend.engine
    token = str(uuid.uuid4())
    mid = stage(engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
    good = parse(
        sns_body(ses_event("send", provider_id="ses-15", message_id=mid, claim_token=token))
    )
    bad = SesEvent(**{**{f: getattr(good, f) for f in good.__slots__}, "key": "k" * 100})
    with engine.begin() as conn:
        done = apply_events(conn, [bad, good], now=NOW)
    assert effects(done) == ["refused", "resolved"]
    assert [a.delete for a in done] == [False, True]
    assert row(engine, mid).status == "sent"
    assert len(event_rows(engine)) == 1


def _session_id(conn: sa.Connection) -> int:
    query = (
        "SELECT pg_backend_pid()" if conn.dialect.name == "postgresql" else "SELECT CONNECTION_ID()"
    )
    return int(conn.exec_driver_sql(query).scalar_one())


def _blocked(engine: sa.Engine, session: int) -> bool:
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            return bool(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE pid = :p AND wait_event_type = 'Lock'"
                    ),
                    {"p": session},
                ).scalar_one()
            )
        status = conn.exec_driver_sql("SHOW ENGINE INNODB STATUS").one()[2]
        return any(
            f"thread id {session}," in t and "\nLOCK WAIT " in t
            for t in status.split("\n---TRANSACTION ")[1:]
        )


def test_two_replicas_applying_one_event_at_once_apply_it_once(server_backend: Backend):
    """Replica A has applied the event and not committed; replica B's insert of the same key
    waits for A (the unique key decides, not a read before it), then finds it recorded."""
    engine = make_engine(server_backend.url)  # the relay's own: READ COMMITTED on MariaDB
    try:
        token = str(uuid.uuid4())
        mid = stage(engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
        body = sns_body(
            ses_event("delivery", provider_id="ses-16", message_id=mid, claim_token=token)
        )
        event = parse(body)
        b_result: list[Any] = []
        b_session: list[int] = []

        def replica_b() -> None:
            try:
                with engine.begin() as conn:
                    b_session.append(_session_id(conn))
                    b_result.extend(apply_events(conn, [event], now=NOW))
            except BaseException as exc:  # seen by the test below
                b_result.append(exc)

        with engine.connect() as a:
            with a.begin():
                (a_done,) = apply_events(a, [event], now=NOW)
                b = threading.Thread(target=replica_b, daemon=True)
                b.start()
                wait_for(
                    lambda: b_session and _blocked(engine, b_session[0]),
                    timeout=10,
                    what="replica B to wait on A's event key",
                )
            b.join(15)
        assert not b.is_alive()
        assert a_done.effect is Effect.RESOLVED
        assert [getattr(x, "effect", x) for x in b_result] == [Effect.DUPLICATE]
        assert len(event_rows(engine)) == 1
        assert [a.outcome for a in attempt_rows(engine, mid)] == ["ambiguous", "reconciled"]
    finally:
        engine.dispose()


def test_replicas_racing_on_overlapping_batches_apply_each_event_once(server_backend: Backend):
    """Four replicas apply shuffled copies of one batch at the same moment: every event is
    recorded once and every row resolved once (a deadlock would raise here: the key order
    prevents it)."""
    engine = make_engine(server_backend.url)
    try:
        rows_ = []
        for n in range(8):
            token = str(uuid.uuid4())
            rows_.append((stage(engine, Status.UNKNOWN_OUTCOME, tokens=(token,)), token, n))
        batch = [
            parse(
                sns_body(
                    ses_event(kind, provider_id=f"ses-r{n}", message_id=mid, claim_token=token)
                )
            )
            for mid, token, n in rows_
            for kind in ("send", "delivery")
        ]
        start = threading.Barrier(4)
        results: list[Any] = []

        def replica(seed: int) -> None:
            mine = list(batch)
            random.Random(seed).shuffle(mine)
            start.wait()
            try:
                with engine.begin() as conn:
                    results.extend(apply_events(conn, mine, now=NOW))
            except BaseException as exc:
                results.append(exc)

        threads = [threading.Thread(target=replica, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors == []
        counted = collections.Counter(r.effect for r in results)
        assert counted[Effect.DUPLICATE] == 3 * len(batch)
        assert counted[Effect.RESOLVED] == len(rows_)
        assert len(event_rows(engine)) == len(batch)
        for mid, _, _n in rows_:
            assert row(engine, mid).status == "sent"
            assert [a.outcome for a in attempt_rows(engine, mid)] == ["ambiguous", "reconciled"]
    finally:
        engine.dispose()


def test_a_missing_table_fails_the_whole_batch_instead_of_refusing_each_event(
    postgres_backend: Backend,
):
    """A schema or grant mistake is not the events' fault: the batch raises (the loop deletes
    nothing and retries) instead of leaving every event for the dead-letter queue."""
    engine = postgres_backend.engine
    event = parse(sns_body(ses_event("send", provider_id="ses-17", message_id=1, claim_token="t")))
    with engine.connect() as conn:
        transaction = conn.begin()  # PostgreSQL's DDL is transactional: rolled back below
        conn.exec_driver_sql("ALTER TABLE outbox_events RENAME TO outbox_events_gone")
        with pytest.raises(sa.exc.ProgrammingError):
            apply_events(conn, [event], now=NOW)
        transaction.rollback()
    assert event_rows(engine) == []
