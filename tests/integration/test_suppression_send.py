"""Suppression at send: the relay never mails an address in outbox_suppressions.

A wave's recipients (To, Cc, Bcc, as lower-cased addr-specs) are looked up before its
send-started mark. All suppressed: the message fails with ``suppressed`` and the sender is never
called; some: the send goes to the rest and the attempt row names who was dropped; the stored
payload stays as enqueued. On SQLite, PostgreSQL and MariaDB.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from outbox.message import Email
from relay import signals, store
from relay.senders import OutgoingMessage, Transient
from relay.senders.ses import build_request
from relay.testing import FakeSender
from tests.support.db import attempt_rows, row
from tests.support.factories import enqueue
from tests.support.hand_clocks import Clock
from tests.support.inprocess import closing, receiving, relay_for, settle
from tests.support.suppressions import mail, suppress


def deliver(backend, *emails: Email) -> tuple[list[int], FakeSender, list[dict]]:
    ids = enqueue(backend.engine, emails)
    sender = FakeSender()
    relay = relay_for(backend, sender)
    with closing(relay), receiving(signals.failed, relay) as failed:
        settle(relay)
        settle(relay)
    return ids, sender, failed


def test_a_message_to_suppressed_addresses_only_fails_and_is_never_sent(backend):
    suppress(backend.engine, "ann@example.com", "bob@example.com")
    ids, sender, failed = deliver(
        backend, mail(to=["ann@example.com"], cc=["bob@example.com"]), mail(to=["carl@example.com"])
    )
    barred, other = ids
    assert sender.called_ids == [other]
    r = row(backend.engine, barred)
    assert (r.status, r.last_error_code, r.attempt_count, r.provider_message_id) == (
        "failed",
        "suppressed",
        1,
        None,
    )
    assert r.send_started_at is None  # never marked: no send began
    [attempt] = attempt_rows(backend.engine, barred)
    assert (attempt.outcome, attempt.error_code) == ("suppressed", "suppressed")
    assert attempt.dropped_recipients == "ann@example.com,bob@example.com"
    assert [(f["message_id"], f["code"], f["outcome"]) for f in failed] == [
        (barred, "suppressed", "suppressed")
    ]
    assert row(backend.engine, other).status == "sent"


def test_some_suppressed_recipients_are_dropped_and_the_rest_get_it(backend):
    suppress(backend.engine, "bob@example.com", "dan@example.com")
    email = mail(
        to=["ann@example.com", "bob@example.com"],
        cc=["carl@example.com", "dan@example.com"],
        bcc=["eve@example.com"],
    )
    (mid,), sender, failed = deliver(backend, email)
    [call] = sender.calls
    assert call.email.to == ("ann@example.com",)
    assert call.email.cc == ("carl@example.com",)
    assert call.email.bcc == ("eve@example.com",)
    assert failed == []
    r = row(backend.engine, mid, payload=True)
    assert (r.status, r.provider_message_id) == ("sent", f"fake-{mid}-1")
    stored = Email.from_payload(r.payload)  # the payload is not rewritten
    assert (stored.to, stored.cc, stored.bcc) == (email.to, email.cc, email.bcc)
    [attempt] = attempt_rows(backend.engine, mid)
    assert attempt.outcome == "accepted"
    assert attempt.dropped_recipients == "bob@example.com,dan@example.com"


def test_no_suppressed_recipient_changes_nothing(backend):
    suppress(backend.engine, "someone-else@example.com")
    email = mail(to=["ann@example.com"], cc=["Bob <bob@example.com>"])
    (mid,), sender, _failed = deliver(backend, email)
    [call] = sender.calls
    assert call.email == email
    [attempt] = attempt_rows(backend.engine, mid)
    assert (attempt.outcome, attempt.dropped_recipients) == ("accepted", None)


@pytest.mark.parametrize(
    "recipient",
    [
        "Ann@Example.COM",
        "ANN@example.com",
        "Ann Smith <Ann@Example.com>",
        '"Smith, Ann" <ann@EXAMPLE.com>',
    ],
)
def test_matching_ignores_case_and_display_names(backend, recipient):
    suppress(backend.engine, "ann@example.com")
    (mid,), sender, failed = deliver(backend, mail(to=[recipient]))
    assert sender.calls == []
    assert row(backend.engine, mid).last_error_code == "suppressed"
    assert attempt_rows(backend.engine, mid)[0].dropped_recipients == "ann@example.com"
    assert len(failed) == 1


def test_a_display_named_recipient_is_dropped_and_the_others_keep_their_names(backend):
    suppress(backend.engine, "bob@example.com")
    email = mail(to=["Ann <ann@example.com>", "Bob <BOB@example.com>"])
    (mid,), sender, _failed = deliver(backend, email)
    [call] = sender.calls
    assert call.email.to == ("Ann <ann@example.com>",)
    assert attempt_rows(backend.engine, mid)[0].dropped_recipients == "bob@example.com"


def test_a_suppression_added_before_a_retry_applies_to_that_retry(backend):
    (mid,) = enqueue(backend.engine, [mail(to=["ann@example.com", "bob@example.com"])])
    clock = Clock()
    sender = FakeSender([Transient(code="Throttling")])
    relay = relay_for(backend, sender, clock)
    with closing(relay):
        settle(relay)
        suppress(backend.engine, "bob@example.com")
        clock.advance(3600)
        settle(relay)
    first, second = sender.calls
    assert first.email.to == ("ann@example.com", "bob@example.com")
    assert second.email.to == ("ann@example.com",)
    assert [(a.outcome, a.dropped_recipients) for a in attempt_rows(backend.engine, mid)] == [
        ("transient", None),
        ("accepted", "bob@example.com"),
    ]


def test_one_lookup_screens_a_whole_wave(backend):
    suppress(backend.engine, "c3@example.com")
    ids = enqueue(backend.engine, 6, short=True)
    statements: list[str] = []

    def seen(conn, cursor, statement, *args):
        if "outbox_suppressions" in statement:
            statements.append(statement)

    sender = FakeSender()
    relay = relay_for(backend, sender, batch_size=6, concurrency=6)
    sa.event.listen(backend.engine, "before_cursor_execute", seen)
    try:
        with closing(relay):
            settle(relay)
    finally:
        sa.event.remove(backend.engine, "before_cursor_execute", seen)
    assert sorted(sender.called_ids) == [i for i in ids if i != ids[3]]
    assert len(statements) == 1


def test_the_claims_write_screens_the_wave_and_never_marks_a_barred_claim(backend):
    """``take_batch`` with the wave's screen: the listed addresses come back, and a new
    claim whose every recipient is listed is written (claimed) but never marked sent; one
    with a recipient left is marked, as is one the list does not touch. An earlier claim's
    addresses (an id outside this take) are looked up with the rest. On PostgreSQL the
    lookup, the claim and the marks are one statement."""
    suppress(backend.engine, "cy@example.com", "dee@example.com")
    ids = enqueue(backend.engine, 3)
    screen = [
        (ids[0], ["ann@example.com"]),
        (ids[1], ["cy@example.com", "dee@example.com"]),
        (ids[2], ["cy@example.com", "bob@example.com"]),
        (ids[2] + 1000, ["dee@example.com", "eve@example.com"]),  # an earlier pass's claim
    ]
    statements: list[str] = []
    now = datetime.now(UTC)
    with backend.engine.begin() as conn:
        taking = store.lock_batch(conn, relay_id="r", limit=10, now=now, lease_seconds=60)
        assert sorted(c.id for c in taking.claims) == ids

        def seen(conn, cursor, statement, *args):
            statements.append(statement)

        sa.event.listen(conn, "before_cursor_execute", seen)
        took = store.take_batch(conn, taking, mark=ids, now=now, screen=screen)
        sa.event.remove(conn, "before_cursor_execute", seen)
    assert took.suppressed == {"cy@example.com", "dee@example.com"}
    assert took.stamped == {ids[0], ids[2]}
    barred = row(backend.engine, ids[1])
    assert (barred.status, barred.claim_token) == ("processing", taking.token)
    assert barred.send_started_at is None
    assert row(backend.engine, ids[0]).send_started_at is not None
    if backend.name == "postgresql":
        assert len(statements) == 1, statements


def test_a_pass_whose_screening_statement_fails_rolls_back_whole_and_screens_again(backend):
    """The suppression lookup fails alone (on PostgreSQL it is the claim's write too): the
    pass rolls back whole, no row is claimed, marked or failed, and the next pass claims,
    screens and settles both messages, each once; the barred one is never sent."""
    suppress(backend.engine, "cy@example.com")
    barred, other = enqueue(backend.engine, [mail(to=["cy@example.com"]), mail()])
    sender = FakeSender()
    relay = relay_for(backend, sender)
    failures = []

    def fail_once(conn, cursor, statement, parameters, context, executemany):
        if "outbox_suppressions" in statement and not failures:
            failures.append(statement)
            return "SELECT * FROM outbox_no_such_table", parameters  # refused alone
        return statement, parameters

    sa.event.listen(backend.engine, "before_cursor_execute", fail_once, retval=True)
    try:
        with closing(relay):
            assert relay.connection.guard(relay.step) is None  # the pass saw the error
            assert len(failures) == 1
            for mid in (barred, other):
                r = row(backend.engine, mid)
                assert (r.status, r.claim_token, r.send_started_at) == ("pending", None, None)
            assert sender.calls == []
            settle(relay)
    finally:
        sa.event.remove(backend.engine, "before_cursor_execute", fail_once)
    assert sender.called_ids == [other]
    assert (row(backend.engine, barred).status, row(backend.engine, other).status) == (
        "failed",
        "sent",
    )
    assert row(backend.engine, barred).send_started_at is None
    assert [a.outcome for a in attempt_rows(backend.engine, barred)] == ["suppressed"]


def test_suppressed_among_reads_only_the_addresses_asked_for(backend):
    suppress(backend.engine, "ann@example.com", "bob@example.com")
    with backend.engine.connect() as conn:
        assert store.suppressed_among(conn, []) == set()
        assert store.suppressed_among(conn, ["bob@example.com", "carl@example.com"]) == {
            "bob@example.com"
        }


def test_every_send_is_tagged_with_its_attempt(backend):
    """The claim token reaches the sender, and SES's tags carry it beside the row's id, so
    an event maps to the attempt it reports on; the attempt row keeps the same token."""
    (mid,) = enqueue(backend.engine, 1)
    sender = FakeSender()
    relay = relay_for(backend, sender)
    with closing(relay):
        settle(relay)
    [call] = sender.calls
    [attempt] = attempt_rows(backend.engine, mid)
    assert call.claim_token is not None
    assert call.claim_token == attempt.claim_token
    tags = {t["Name"]: t["Value"] for t in build_request(call)["EmailTags"]}
    assert tags["outbox_attempt"] == call.claim_token
    assert tags["outbox_message_id"] == str(mid)


def test_the_relays_tags_win_over_an_emails_own_of_the_same_name():
    """An email stored before ``outbox_attempt`` was reserved may carry it: SES refuses a
    request naming one tag twice, so the relay's value replaces it."""
    email = mail(tags={"campaign": "spring"})
    object.__setattr__(email, "tags", {"campaign": "spring", "outbox_attempt": "forged"})
    message = OutgoingMessage(
        id=7, key="k", category="transactional", attempt=1, email=email, claim_token="t-1"
    )
    assert build_request(message)["EmailTags"] == [
        {"Name": "campaign", "Value": "spring"},
        {"Name": "outbox_message_id", "Value": "7"},
        {"Name": "outbox_attempt", "Value": "t-1"},
        {"Name": "outbox_category", "Value": "transactional"},
    ]
