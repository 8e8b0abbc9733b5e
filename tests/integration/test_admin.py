"""Operator commands and the SQL views, on SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox.schema import attempts, events, messages, operator_actions, relays
from relay import store
from relay.admin import parse_duration
from relay.cli import main
from tests.support.factories import enqueue


def set_rows(engine, ids, **values) -> None:
    with engine.begin() as conn:
        conn.execute(messages.update().where(messages.c.id.in_(ids)).values(**values))


def cli(backend, *args: str):
    result = CliRunner().invoke(
        main, [*args], env={"OUTBOX_DATABASE_URL": backend.url}, catch_exceptions=False
    )
    return result


def status_of(engine, mid: int) -> str:
    with engine.connect() as conn:
        return conn.execute(sa.select(messages.c.status).where(messages.c.id == mid)).scalar_one()


def view(engine, name: str) -> list[dict]:
    with engine.connect() as conn:
        return store.read_view(conn, name)


@pytest.fixture
def backlog(backend):
    """Two pending, one unknown_outcome with two provider ids in its attempts, two failed with
    the same code, one failed with another, one sent, and a relay heartbeat."""
    engine = backend.engine
    ids = enqueue(engine, 8, prefix="k", short=True)
    now = datetime.now(UTC)
    set_rows(
        engine,
        [ids[2]],
        status="unknown_outcome",
        claimed_by="relay-a",
        attempt_count=1,
        claimed_at=now,
        send_started_at=now,
        last_error_code="ReadTimeoutError",
    )
    set_rows(
        engine,
        ids[3:5],
        status="failed",
        attempt_count=1,
        last_error_code="MessageRejected",
        last_error_message="not verified",
    )
    set_rows(
        engine,
        [ids[5]],
        status="failed",
        attempt_count=10,
        last_error_code="Throttling",
        last_error_message="exhausted",
    )
    set_rows(
        engine, [ids[6]], status="sent", attempt_count=1, provider_message_id="ses-6", sent_at=now
    )
    set_rows(engine, [ids[7]], next_attempt_at=now + timedelta(hours=1))  # pending, not due
    with engine.begin() as conn:
        for provider_id in ("ses-a", "ses-b"):
            conn.execute(
                attempts.insert().values(
                    message_id=ids[2],
                    claim_token="t",
                    relay_id="relay-a",
                    started_at=now,
                    finished_at=now,
                    outcome="ambiguous",
                    provider_message_id=provider_id,
                )
            )
        conn.execute(
            relays.insert().values(
                relay_id="relay-a",
                host="h",
                pid=1,
                started_at=now,
                heartbeat_at=now - timedelta(seconds=5),
                state="running",
            )
        )
    return ids


def test_views_describe_the_backlog(backend, backlog):
    engine = backend.engine
    counts = {
        (r["category"], r["status"]): r["message_count"]
        for r in view(engine, "outbox_status_summary")
    }
    assert counts == {
        ("default", "pending"): 3,
        ("default", "unknown_outcome"): 1,
        ("default", "failed"): 3,
        ("default", "sent"): 1,
    }
    (lag,) = view(engine, "outbox_lag")
    assert lag["category"] == "default"
    assert lag["due_count"] == 2  # the not-due pending message is not lag
    assert 0 <= float(lag["lag_seconds"]) < 600
    (unknown,) = view(engine, "outbox_unknown_outcomes")
    assert unknown["id"] == backlog[2]
    assert unknown["idempotency_key"] == "k:2"
    assert unknown["claimed_by"] == "relay-a"
    assert unknown["recipients"] == "c2@example.com"
    assert sorted(unknown["provider_message_ids"].split(",")) == ["ses-a", "ses-b"]
    failures = {r["error_code"]: r for r in view(engine, "outbox_failures")}
    assert failures["MessageRejected"]["message_count"] == 2
    assert failures["MessageRejected"]["newest_message_id"] == backlog[4]
    assert failures["MessageRejected"]["newest_error_message"] == "not verified"
    assert failures["Throttling"]["message_count"] == 1
    (health,) = view(engine, "outbox_relay_health")
    assert health["state"] == "running"
    assert 4 <= float(health["heartbeat_age_seconds"]) < 600


def test_status_matches_the_views(backend, backlog):
    result = cli(backend, "status", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["unknown_outcomes"] == 1
    assert {r["status"] for r in report["status_summary"]} == {
        "pending",
        "unknown_outcome",
        "failed",
        "sent",
    }
    text = cli(backend, "status").output
    assert "unknown_outcome: 1" in text
    assert "MessageRejected" in text
    assert "relay-a" in text


def test_list_filters_and_pages(backend, backlog):
    out = json.loads(cli(backend, "list", "--status", "failed", "--json").output)
    assert [r["id"] for r in out] == backlog[3:6]
    page = json.loads(cli(backend, "list", "--limit", "3", "--json").output)
    assert [r["id"] for r in page] == backlog[:3]
    nxt = json.loads(
        cli(backend, "list", "--limit", "3", "--after-id", str(backlog[2]), "--json").output
    )
    assert [r["id"] for r in nxt] == backlog[3:6]
    assert [r["id"] for r in json.loads(cli(backend, "list", "--key", "k:7", "--json").output)] == [
        backlog[7]
    ]
    assert len(json.loads(cli(backend, "list", "--key", "k:*", "--json").output)) == 8
    assert json.loads(cli(backend, "list", "--older-than", "1h", "--json").output) == []
    assert "more: --after-id" in cli(backend, "list", "--limit", "2").output


def test_show_has_the_row_and_its_attempts_but_no_body(backend, backlog):
    result = cli(backend, "show", str(backlog[2]), "--json")
    data = json.loads(result.output)
    assert data["message"]["status"] == "unknown_outcome"
    assert [a["provider_message_id"] for a in data["attempts"]] == ["ses-a", "ses-b"]
    assert "payload" not in data["message"]
    assert cli(backend, "show", "999999").exit_code == 1


def test_requeue_records_the_reason_and_refuses_bad_ids_without_changing_anything(backend, backlog):
    engine = backend.engine
    refused = cli(backend, "requeue", str(backlog[2]), str(backlog[0]))  # 0 is pending
    assert refused.exit_code == 1
    assert "cannot requeue" in refused.output
    assert status_of(engine, backlog[2]) == "unknown_outcome"
    assert cli(backend, "requeue", str(backlog[2]), "999999").exit_code == 1
    assert status_of(engine, backlog[2]) == "unknown_outcome"
    done = cli(backend, "requeue", str(backlog[2]), "--reason", "not in CloudWatch")
    assert done.exit_code == 0, done.output
    assert status_of(engine, backlog[2]) == "pending"
    history = json.loads(cli(backend, "show", str(backlog[2]), "--json").output)["attempts"]
    assert history[-1]["outcome"] == "requeued"
    assert history[-1]["error_message"] == "not in CloudWatch"
    assert history[-1]["relay_id"].startswith("operator")


def test_bulk_requeue_needs_yes(backend, backlog):
    engine = backend.engine
    refused = cli(backend, "requeue", "--status", "failed")
    assert refused.exit_code == 2
    assert "3 messages match; add --yes" in refused.output
    assert status_of(engine, backlog[3]) == "failed"
    assert cli(backend, "requeue", "--status", "pending", "--yes").exit_code == 2
    assert (
        cli(backend, "requeue", "--status", "failed", "--category", "default", "--yes").exit_code
        == 0
    )
    assert [status_of(engine, i) for i in backlog[3:6]] == ["pending"] * 3


def test_cancel(backend, backlog):
    engine = backend.engine
    assert cli(backend, "cancel", str(backlog[6])).exit_code == 1  # sent
    done = cli(backend, "cancel", str(backlog[0]), "--reason", "customer left")
    assert done.exit_code == 0
    assert done.output.strip() == "cancelled 1 message(s)"  # spelled as the status
    assert status_of(engine, backlog[0]) == "cancelled"
    history = json.loads(cli(backend, "show", str(backlog[0]), "--json").output)["attempts"]
    assert (history[-1]["outcome"], history[-1]["error_message"]) == ("cancelled", "customer left")
    assert cli(backend, "cancel", "--key", "k:*").exit_code == 2  # bulk without --yes
    assert cli(backend, "cancel", "--key", "k:*", "--yes").exit_code == 0
    assert status_of(engine, backlog[1]) == "cancelled"
    assert status_of(engine, backlog[2]) == "unknown_outcome"  # not cancellable: untouched


def test_prune_respects_the_dedup_window(backend, backlog):
    engine = backend.engine
    old = datetime.now(UTC) - timedelta(days=40)
    set_rows(engine, [backlog[6]], created_at=old, updated_at=old)  # sent, 40 days ago
    set_rows(
        engine,
        [backlog[3]],
        created_at=datetime.now(UTC) - timedelta(days=10),
        updated_at=datetime.now(UTC) - timedelta(days=10),
    )  # failed, 10 days ago
    set_rows(engine, [backlog[2]], created_at=old, updated_at=old)  # unknown_outcome: kept
    dry = cli(backend, "prune", "--older-than", "1d", "--dry-run")
    assert "would delete 1 message" in dry.output
    result = cli(backend, "prune", "--older-than", "1d", "--batch-size", "1")
    assert "deleted 1 message" in result.output
    with engine.connect() as conn:
        left = set(conn.execute(sa.select(messages.c.id)).scalars())
    assert backlog[6] not in left
    assert {backlog[3], backlog[2]} <= left
    # With a shorter dedup window the 10-day-old failure goes too; its key is free again.
    assert "deleted 1" in cli(backend, "prune", "--older-than", "7d", "--dedup-window", "7d").output
    assert enqueue(engine, 4, prefix="k")[3] != backlog[3]


@pytest.mark.parametrize("text", ["", "5", "1x", "-1d", "d", "5218w", "9999999999999w"])
def test_bad_durations_are_refused(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_durations():
    assert parse_duration("1d12h") == timedelta(days=1, hours=12)
    assert parse_duration("90s") == timedelta(seconds=90)
    assert parse_duration("2w") == timedelta(weeks=2)


def test_bad_filter_changes_nothing(backend, backlog):
    result = cli(backend, "requeue", "--older-than", "soon", "--yes")
    assert result.exit_code == 2
    assert "--older-than" in result.output
    result = cli(backend, "requeue", "1", "--status", "failed")
    assert result.exit_code == 2
    assert "not both" in result.output


def add_event(engine, *, message_id, event_type, received_at, detail=None, effect="status"):
    with engine.begin() as conn:
        conn.execute(
            events.insert().values(
                event_key=f"{message_id}-{event_type}-{received_at.timestamp()}",
                received_at=received_at,
                event_type=event_type,
                event_at=received_at - timedelta(seconds=1),
                mail_at=received_at - timedelta(seconds=2),
                message_id=message_id,
                detail=detail,
                recipients="c6@example.com" if message_id else None,
                effect=effect if message_id else "unmatched",
                source="sns",
            )
        )


def test_show_and_status_say_what_the_provider_events_and_the_operators_did(backend, backlog):
    engine, now = backend.engine, datetime.now(UTC)
    sent = backlog[6]
    set_rows(engine, [sent], delivery_status="bounced", delivery_status_at=now)
    add_event(engine, message_id=sent, event_type="delivery", received_at=now)
    add_event(
        engine, message_id=sent, event_type="bounce", received_at=now, detail="Permanent/General"
    )
    add_event(engine, message_id=None, event_type="delivery", received_at=now)
    assert cli(backend, "resolve", str(backlog[3]), "--delivered", "--actor", "amy").exit_code == 0

    shown = json.loads(cli(backend, "show", str(sent), "--json").output)
    assert shown["message"]["delivery_status"] == "bounced"
    assert shown["message"]["delivery_status_at"].endswith("Z")
    assert [(e["event_type"], e["detail"], e["effect"]) for e in shown["events"]] == [
        ("delivery", None, "status"),
        ("bounce", "Permanent/General", "status"),
    ]
    assert shown["events"][0]["recipients"] == "c6@example.com"
    assert shown["operator_actions"] == []
    resolved = json.loads(cli(backend, "show", str(backlog[3]), "--json").output)
    (action,) = resolved["operator_actions"]
    assert (action["action"], action["actor"]) == ("resolve_delivered", "amy")
    text = cli(backend, "show", str(backlog[3])).output
    assert "operator actions (1)" in text
    assert "resolve_delivered" in text
    assert "(no provider event recorded)" in text  # sent, and no event says more

    report = json.loads(cli(backend, "status", "--json").output)
    (summary,) = report["delivery_summary"]
    assert summary["category"] == "default"
    assert (summary["sent_count"], summary["bounced_count"], summary["no_event_count"]) == (
        2,
        1,
        1,
    )
    assert summary["bounce_rate"] == 0.5
    assert type(summary["sent_count"]) is int
    intake = report["event_intake"]
    assert (intake["events_24h"], intake["unmatched_24h"], intake["malformed_24h"]) == (3, 1, 0)
    assert 0 <= intake["newest_age_seconds"] < 600
    assert intake["newest_received_at"].endswith("Z")
    text = cli(backend, "status").output
    assert "50.00%" in text
    assert "bounce rate near SES's 5% review level" in text
    assert "3 event(s) in 24 h, 1 unmatched, 0 malformed" in text


def test_status_says_when_no_event_ever_came(backend, backlog):
    report = json.loads(cli(backend, "status", "--json").output)
    assert report["event_intake"]["events_24h"] == 0
    assert report["event_intake"]["newest_received_at"] is None
    assert "no event ever received" in cli(backend, "status").output


def test_prune_takes_events_with_their_messages_and_keeps_unknown_outcomes_unless_told(
    backend, backlog
):
    engine = backend.engine
    old = datetime.now(UTC) - timedelta(days=40)
    set_rows(engine, [backlog[6], backlog[2]], created_at=old, updated_at=old)  # sent, unknown
    assert cli(backend, "resolve", str(backlog[4]), "--delivered").exit_code == 0
    set_rows(engine, [backlog[4]], created_at=old, updated_at=old)  # resolved (sent), old
    add_event(engine, message_id=backlog[6], event_type="delivery", received_at=old)
    add_event(engine, message_id=backlog[2], event_type="send", received_at=old)
    add_event(engine, message_id=None, event_type="bounce", received_at=old)  # unmatched, old
    add_event(engine, message_id=None, event_type="send", received_at=datetime.now(UTC))

    dry = json.loads(cli(backend, "prune", "--older-than", "30d", "--dry-run", "--json").output)
    assert (dry["would_delete"], dry["would_delete_events"]) == (2, 2)
    done = cli(backend, "prune", "--older-than", "30d", "--batch-size", "1", "--actor", "cron")
    assert done.exit_code == 0, done.output
    assert "deleted 2 message(s)" in done.output
    assert "and 2 event(s)" in done.output
    with engine.connect() as conn:
        left = set(conn.execute(sa.select(messages.c.id)).scalars())
        kept_events = sorted(
            (e.message_id or 0, e.event_type) for e in conn.execute(sa.select(events))
        )
    assert {backlog[6], backlog[4]}.isdisjoint(left)
    assert backlog[2] in left  # unknown_outcome: kept
    assert kept_events == sorted([(backlog[2], "send"), (0, "send")])

    again = cli(backend, "prune", "--older-than", "30d", "--include-unknown-outcome", "--json")
    report = json.loads(again.output)
    assert (report["deleted"], report["deleted_events"]) == (1, 1)
    with engine.connect() as conn:
        assert backlog[2] not in set(conn.execute(sa.select(messages.c.id)).scalars())
        log = list(conn.execute(sa.select(operator_actions).order_by(operator_actions.c.id)))
    assert [r.action for r in log] == ["resolve_delivered", "prune", "prune"]  # never pruned
    first, second = (json.loads(r.detail) for r in log[1:])
    assert (first["deleted"], first["deleted_events"], first["include_unknown_outcome"]) == (
        2,
        2,
        False,
    )
    assert (second["deleted"], second["include_unknown_outcome"]) == (1, True)
    assert log[1].actor == "cron"
    assert datetime.fromisoformat(first["cutoff"]) < datetime.now(UTC) - timedelta(days=29)


def test_prune_takes_the_rows_of_relays_that_stopped_long_ago(backend):
    """Every rollout adds a row per pod to outbox_relays: a prune removes those of relays that
    stopped cleanly before --stopped-relays-older-than (7 days), never a running relay's or
    one that died without stopping (its id is taken over when reused)."""
    engine, now = backend.engine, datetime.now(UTC)
    rows = [
        ("old-stopped", "stopped", now - timedelta(days=8)),
        ("new-stopped", "stopped", now - timedelta(days=1)),
        ("old-running", "running", now - timedelta(days=8)),
    ]
    with engine.begin() as conn:
        for relay_id, state, at in rows:
            conn.execute(
                relays.insert().values(
                    relay_id=relay_id, host="h", pid=1, started_at=at, heartbeat_at=at, state=state
                )
            )

    def left() -> list[str]:
        with engine.connect() as conn:
            stmt = sa.select(relays.c.relay_id).order_by(relays.c.relay_id)
            return list(conn.execute(stmt).scalars())

    dry = json.loads(cli(backend, "prune", "--older-than", "30d", "--dry-run", "--json").output)
    assert dry["would_delete_relays"] == 1
    assert left() == ["new-stopped", "old-running", "old-stopped"]
    report = json.loads(cli(backend, "prune", "--older-than", "30d", "--json").output)
    assert report["deleted_relays"] == 1
    assert left() == ["new-stopped", "old-running"]
    done = cli(backend, "prune", "--older-than", "30d", "--stopped-relays-older-than", "1h")
    assert "and 1 stopped relay row(s)" in done.output
    assert left() == ["old-running"]


def test_prune_takes_unmatched_and_foreign_events_after_their_own_short_horizon(backend, backlog):
    """Events matched to no message change nothing and dedupe nothing of ours: a prune takes
    them after --unmatched-events-older-than (3 days), not the 30-day dedup window; a matched
    event stays as long as its message does."""
    engine, now = backend.engine, datetime.now(UTC)
    add_event(
        engine, message_id=backlog[6], event_type="delivery", received_at=now - timedelta(days=10)
    )
    add_event(engine, message_id=None, event_type="bounce", received_at=now - timedelta(days=4))
    add_event(engine, message_id=None, event_type="send", received_at=now - timedelta(days=1))
    with engine.begin() as conn:
        conn.execute(
            events.insert().values(
                event_key="foreign-1",
                received_at=now - timedelta(days=5),
                event_type="send",
                effect="foreign",
                error="from SNS topic arn:aws:sns:us-west-2:210987654321:TheirTopic",
                source="sns",
            )
        )

    dry = json.loads(cli(backend, "prune", "--older-than", "30d", "--dry-run", "--json").output)
    assert (dry["would_delete"], dry["would_delete_events"]) == (0, 2)
    assert dry["unmatched_events_older_than_seconds"] == 3 * 86400
    report = json.loads(cli(backend, "prune", "--older-than", "30d", "--json").output)
    assert (report["deleted"], report["deleted_events"]) == (0, 2)

    def kept() -> list[tuple[int | None, str]]:
        with engine.connect() as conn:
            stmt = sa.select(events.c.message_id, events.c.effect).order_by(events.c.id)
            return [tuple(r) for r in conn.execute(stmt)]

    assert kept() == [(backlog[6], "status"), (None, "unmatched")]
    shorter = cli(backend, "prune", "--older-than", "30d", "--unmatched-events-older-than", "12h")
    assert "and 1 event(s)" in shorter.output
    assert kept() == [(backlog[6], "status")]
