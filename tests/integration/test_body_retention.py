"""Body retention: ``prune --keep-bodies`` drops the payload of finished messages past the
horizon and keeps the row (key, status, recipients, subject, provider id, timestamps,
attempts); the dedup window still holds for the key; a message without its body is never
requeued or sent again; the drop racing an operator's requeue; ``show`` says when it went."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.orm import Session

from outbox import Email, Outbox
from outbox.schema import attempts, messages
from relay import store
from relay.admin.output import text
from relay.cli import main
from relay.doctor import identities_in_use
from relay.events import parse
from relay.intake import apply_events
from relay.store import operator as ops
from relay.testing import FakeSender
from tests.support.inprocess import Run, relay_for
from tests.support.sqs import ses_event, sns_body

OB = Outbox()
OLD = datetime.now(UTC) - timedelta(days=10)
EMAIL = Email(
    sender="shop@example.com",
    to=["ana@example.com"],
    subject="Your reset code",
    text="Your code is 493021.",
    html="<p>Your code is <b>493021</b>.</p>",
)


def cli(url: str, *args: str) -> Any:
    return CliRunner().invoke(main, list(args), env={"OUTBOX_DATABASE_URL": url})


def enqueue(engine: sa.Engine, key: str, **values: Any) -> int:
    """One real enqueue, then ``values`` set on its row (its status, its age)."""
    with Session(engine) as session:
        row_id = OB.enqueue(session, EMAIL, key=key).id
        session.commit()
    if values:
        with engine.begin() as conn:
            conn.execute(sa.update(messages).where(messages.c.id == row_id).values(**values))
    return row_id


def row(engine: sa.Engine, row_id: int) -> dict[str, Any]:
    with engine.connect() as conn:
        found = conn.execute(sa.select(messages).where(messages.c.id == row_id)).one()
    return dict(found._mapping)


KEPT = {"to": ["ana@example.com"]}  # what a dropped body keeps: its address lists


SENT = dict(
    status="sent",
    provider_message_id="0100018c1d2e3f4a-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901-000000",
    sent_at=OLD,
    updated_at=OLD,
    created_at=OLD,
    attempt_count=1,
)


def test_prune_drops_only_finished_bodies_past_the_horizon_and_keeps_the_rest(backend):
    engine, url = backend.engine, backend.url
    finished = {s: enqueue(backend.engine, f"old-{s}", **{**SENT, "status": s})
                for s in ("sent", "failed", "cancelled", "expired")}  # fmt: skip
    kept = {
        "young sent": enqueue(engine, "young", **{**SENT, "updated_at": datetime.now(UTC)}),
        "unknown_outcome": enqueue(engine, "unknown", **{**SENT, "status": "unknown_outcome"}),
        "pending": enqueue(engine, "pending", created_at=OLD, updated_at=OLD),
        "retrying": enqueue(engine, "retrying", status="retrying", updated_at=OLD),
        "processing": enqueue(engine, "processing", status="processing", updated_at=OLD),
    }
    with engine.begin() as conn:
        conn.execute(
            sa.insert(attempts),
            [{"message_id": finished["sent"], "finished_at": OLD, "outcome": "accepted",
              "provider_message_id": SENT["provider_message_id"]}],
        )  # fmt: skip
    before = {i: row(engine, i) for i in [*finished.values(), *kept.values()]}

    dry = cli(url, "prune", "--older-than", "30d", "--keep-bodies", "7d",
              "--keep-failed-bodies", "7d", "--dry-run", "--json")  # fmt: skip
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout)["would_drop_bodies"] == 4
    assert all(row(engine, i)["body_dropped_at"] is None for i in finished.values())

    done = cli(url, "prune", "--older-than", "30d", "--keep-bodies", "7d",
               "--keep-failed-bodies", "7d", "--batch-size", "3", "--json")  # fmt: skip
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert (report["bodies_dropped"], report["deleted"]) == (4, 0)
    assert report["keep_bodies_seconds"] == 7 * 86400
    for status, row_id in finished.items():
        after = row(engine, row_id)
        assert after["payload"] == KEPT, status
        assert after["body_dropped_at"] is not None
        unchanged = {k: v for k, v in before[row_id].items() if k not in ("payload",
                     "body_dropped_at")}  # fmt: skip
        assert {k: after[k] for k in unchanged} == unchanged  # key, subject, timestamps...
        assert after["recipients"]
        assert after["subject"] == "Your reset code"
    for name, row_id in kept.items():
        assert row(engine, row_id) == before[row_id], name
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(attempts)).scalar_one() == 1

    again = cli(url, "prune", "--older-than", "30d", "--keep-bodies", "7d", "--json")
    assert json.loads(again.stdout)["bodies_dropped"] == 0  # a second pass finds none

    at_once = cli(url, "prune", "--older-than", "30d", "--keep-bodies", "0", "--json")
    assert json.loads(at_once.stdout)["bodies_dropped"] == 1  # the young sent one
    assert row(engine, kept["young sent"])["payload"] == KEPT
    with engine.connect() as conn:
        logged = conn.execute(sa.text(
            "SELECT detail FROM outbox_operator_actions WHERE action = 'prune' ORDER BY id"
        )).scalars().all()  # fmt: skip
    assert [json.loads(d)["bodies_dropped"] for d in logged] == [4, 0, 1]


def test_failed_messages_keep_their_body_longer_by_default_and_never_means_never(backend):
    """A failed message is requeued once its cause is fixed, so by default its body stays
    30 days, not 7; ``never`` keeps either kind."""
    engine, url = backend.engine, backend.url
    days = {d: datetime.now(UTC) - timedelta(days=d) for d in (10, 40)}
    sent = enqueue(engine, "sent-10", **{**SENT, "updated_at": days[10]})
    failed = {
        d: enqueue(engine, f"failed-{d}", **{**SENT, "status": "failed", "updated_at": at})
        for d, at in days.items()
    }
    kept = cli(url, "prune", "--older-than", "60d", "--keep-bodies", "never",
               "--keep-failed-bodies", "never", "--json")  # fmt: skip
    assert kept.exit_code == 0, kept.output
    report = json.loads(kept.stdout)
    assert report["bodies_dropped"] == 0
    assert (report["keep_bodies_seconds"], report["bodies_cutoff"]) == (None, None)
    done = cli(url, "prune", "--older-than", "60d", "--json")
    assert json.loads(done.stdout)["bodies_dropped"] == 2
    assert json.loads(done.stdout)["keep_failed_bodies_seconds"] == 30 * 86400
    dropped = {i for i in (sent, *failed.values()) if row(engine, i)["body_dropped_at"]}
    assert dropped == {sent, failed[40]}
    plain = cli(url, "prune", "--older-than", "60d", "--keep-bodies", "never")
    assert "(sent, cancelled, expired: never; failed finished before" in plain.stdout
    bad = cli(url, "prune", "--older-than", "60d", "--keep-failed-bodies", "sometimes")
    assert bad.exit_code == 2
    assert "--keep-failed-bodies" in bad.stderr


def test_the_key_still_dedupes_after_its_body_is_dropped(backend):
    engine, url = backend.engine, backend.url
    first = enqueue(engine, "order-1", **SENT)
    assert cli(url, "prune", "--older-than", "30d", "--keep-bodies", "0").exit_code == 0
    with Session(engine) as session:
        again = OB.enqueue(session, EMAIL, key="order-1")
        session.commit()
    assert again.duplicate
    assert again.id == first
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(messages)).scalar_one() == 1


def test_show_says_when_the_body_was_dropped(backend):
    engine, url = backend.engine, backend.url
    row_id = enqueue(engine, "shown", **SENT)
    assert cli(url, "prune", "--older-than", "30d", "--keep-bodies", "0").exit_code == 0
    dropped_at = row(engine, row_id)["body_dropped_at"]
    assert dropped_at is not None

    shown = cli(url, "show", str(row_id), "--body", "--json")
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.stdout)
    assert report["body"] == {"error": f"prune dropped it at {text(dropped_at)} (--keep-bodies)"}
    assert report["message"]["body_dropped_at"] is not None
    assert report["message"]["attachments"] is None  # not known, rather than none
    assert report["message"]["subject"] == "Your reset code"
    assert "personal data" not in shown.stderr  # no body is shown

    plain = cli(url, "show", str(row_id), "--body")
    assert "body_dropped_at" in plain.stdout
    assert "body: prune dropped it at" in plain.stdout
    assert "493021" not in plain.stdout


def test_a_message_without_its_body_is_never_requeued(backend):
    engine, url = backend.engine, backend.url
    dropped = enqueue(engine, "failed-old", **{**SENT, "status": "failed"})
    whole = enqueue(engine, "failed-new", **{**SENT, "status": "failed",
                                             "updated_at": datetime.now(UTC)})  # fmt: skip
    pruned = cli(url, "prune", "--older-than", "30d", "--keep-failed-bodies", "7d")
    assert pruned.exit_code == 0, pruned.output

    by_id = cli(url, "requeue", str(dropped))
    assert by_id.exit_code == 1
    assert f"cannot requeue {dropped}: prune dropped the body" in by_id.stderr
    assert row(engine, dropped)["status"] == "failed"

    by_filter = cli(url, "requeue", "--status", "failed", "--yes", "--json")
    assert by_filter.exit_code == 0, by_filter.output
    report = json.loads(by_filter.stdout)
    assert (report["requeued_ids"], report["left_out_bodiless_ids"]) == ([whole], [dropped])
    assert "1 matching message(s) left out: prune dropped their bodies" in by_filter.stderr

    with engine.begin() as conn:  # the store's own guard, whatever the command checked
        assert store.requeue_many(conn, ids=[dropped], now=datetime.now(UTC)) == []

    resolved = cli(url, "resolve", str(dropped), "--not-delivered")
    assert resolved.exit_code == 1
    assert "prune dropped its body at" in resolved.stderr
    assert row(engine, dropped)["status"] == "failed"
    assert cli(url, "resolve", str(dropped), "--delivered").exit_code == 0  # closing it is fine


def test_the_drop_waits_out_a_requeue_holding_the_row_and_then_leaves_it(server_backend):
    """An operator's requeue holds the row (its transaction open) while prune runs: the drop
    skips the locked row rather than wait or drop a body about to be sent, and once the
    requeue commits the row is pending with its body; the next prune leaves it too."""
    engine, url = server_backend.engine, server_backend.url
    row_id = enqueue(engine, "racing", **{**SENT, "status": "failed"})
    locked = threading.Event()
    release = threading.Event()

    def requeue() -> None:
        with engine.begin() as conn:
            ops.lock_for_change(conn, [row_id])
            locked.set()
            release.wait(10)
            assert store.requeue_many(conn, ids=[row_id], now=datetime.now(UTC)) == [row_id]

    thread = threading.Thread(target=requeue)
    thread.start()
    try:
        assert locked.wait(10)
        pruned = cli(url, "prune", "--older-than", "30d", "--keep-bodies", "0", "--json")
        assert pruned.exit_code == 0, pruned.output
        assert json.loads(pruned.stdout)["bodies_dropped"] == 0
    finally:
        release.set()
        thread.join(10)
    after = row(engine, row_id)
    assert (after["status"], after["body_dropped_at"]) == ("pending", None)
    assert after["payload"]["text"] == EMAIL.text
    pruned = cli(url, "prune", "--older-than", "30d", "--keep-bodies", "0", "--json")
    assert json.loads(pruned.stdout)["bodies_dropped"] == 0


def test_a_requeue_waiting_on_the_drop_finds_the_body_gone_and_changes_nothing(server_backend):
    """The other order: the drop's batch holds the row when the requeue comes; the requeue
    waits, then re-reads the row, finds the body gone, and leaves it failed."""
    engine = server_backend.engine
    row_id = enqueue(engine, "racing", **{**SENT, "status": "failed"})
    done: list[list[int]] = []
    with engine.begin() as conn:
        now = datetime.now(UTC)
        assert ops.drop_bodies(conn, before=now, failed_before=now, now=now, limit=10) == (
            1,
            row_id,
        )

        def requeue() -> None:
            with engine.begin() as other:
                done.append(store.requeue_many(other, ids=[row_id], now=datetime.now(UTC)))

        thread = threading.Thread(target=requeue)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()  # waiting on the drop's row lock
    thread.join(10)
    assert done == [[]]
    after = row(engine, row_id)
    assert (after["status"], after["payload"]) == ("failed", KEPT)


def test_a_bodiless_row_forced_back_into_the_queue_fails_unsent(backend):
    """Past every guard (a hand-written UPDATE puts a dropped row back to pending): the relay
    reads ``{}``, no email, and fails the row as invalid_payload; nothing is sent."""
    engine, url = backend.engine, backend.url
    row_id = enqueue(engine, "forced", **SENT)
    assert cli(url, "prune", "--older-than", "30d", "--keep-bodies", "0").exit_code == 0
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == row_id)
            .values(status="pending", next_attempt_at=OLD, fair_at=OLD, attempt_count=0)
        )
    sender = FakeSender()
    run = Run(relay_for(backend, sender, exit_when_idle=True))
    assert run.returned_within(10)
    assert run.errors == []
    assert sender.called_ids == []
    after = row(engine, row_id)
    assert (after["status"], after["last_error_code"]) == ("failed", "invalid_payload")


def test_a_late_complaint_still_suppresses_its_addresses_after_the_body_is_dropped(backend):
    """Complaints come days or weeks after the send: with the body gone, the event still
    matches its row, raises its delivery status and suppresses exactly the addresses the
    message went to (To, Cc, Bcc, display names aside), which the dropped body keeps."""
    engine, url = backend.engine, backend.url
    with Session(engine) as session:
        row_id = OB.enqueue(
            session,
            Email(
                sender="shop@example.com",
                to=['"Doe, Jane" <Jane@Example.com>'],
                cc=["cc@example.com"],
                bcc=["hidden@example.com"],
                subject="S",
                text="t",
            ),
            key="complained",
        ).id
        session.commit()
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == row_id)
            .values(**{**SENT, "provider_message_id": "ses-late"})
        )
    assert cli(url, "prune", "--older-than", "30d", "--keep-bodies", "0").exit_code == 0
    assert row(engine, row_id)["payload"] == {  # the lists alone: no text, no sender
        "to": ['"Doe, Jane" <Jane@example.com>'],  # the domain as Email normalized it
        "cc": ["cc@example.com"],
        "bcc": ["hidden@example.com"],
    }
    complaint = ses_event("notification_complaint", provider_id="ses-late", to="jane@example.com")
    complaint["complaint"]["complainedRecipients"] += [
        {"emailAddress": a} for a in ("CC@example.com", "hidden@example.com", "doe@example.com")
    ]
    with engine.begin() as conn:
        (done,) = apply_events(conn, [parse(sns_body(complaint))], now=datetime.now(UTC))
    assert done.effect.value == "status"
    assert done.suppressed == ("cc@example.com", "hidden@example.com", "jane@example.com")
    assert row(engine, row_id)["delivery_status"] == "complained"


def test_doctor_finds_the_from_address_among_the_rows_that_kept_their_body(backend):
    """doctor and send-test take the From in use from the newest payloads: bodiless rows are
    passed over (they name no sender), within a bounded read of the newest rows."""
    engine, url = backend.engine, backend.url
    enqueue(engine, "queued")  # pending: keeps its body
    for i in range(12):  # newer, and bodiless after the prune
        enqueue(engine, f"sent-{i}", **SENT)
    assert cli(url, "prune", "--older-than", "30d", "--keep-bodies", "0").exit_code == 0
    with engine.connect() as conn:
        assert [p["sender"] for p in store.recent_payloads(conn, limit=2)] == ["shop@example.com"]
        assert store.recent_payloads(conn, limit=1) == []  # only the newest ten rows are read
    assert identities_in_use(engine) == (["shop@example.com"], [])
