"""What ``status``, ``list`` and ``show`` print, through the real CLI on SQLite, PostgreSQL
and MariaDB: numbers as JSON numbers, every timestamp ISO 8601 in UTC with ``Z`` (JSON and
text alike), NULL as null, rows in a stable order. The drivers return different types for the
same view (text, naive or zoned datetimes; ``Decimal`` or float), so each case runs on all
three."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.orm import Session

from outbox import Category, Email, Outbox
from outbox.schema import attempts, messages, relays
from relay.cli import main

JSON_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
TEXT_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
ANY_TIME = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d(\.\d+)?)?(Z|[+-]\d\d:\d\d)?")
MULTI_LINE_ERROR = 'connection reset\nDETAIL:  "peer" went away'
OB = Outbox(categories=[Category(name=name) for name in ("alpha", "receipts", "zeta")])


def cli(backend: Any, *args: str) -> str:
    result = CliRunner().invoke(
        main, list(args), env={"OUTBOX_DATABASE_URL": backend.url}, catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return result.output


def utc_time(text: Any) -> datetime:
    """A ``--json`` timestamp: the one form, read back by ``datetime.fromisoformat`` as UTC."""
    assert isinstance(text, str), text
    assert JSON_TIME.fullmatch(text), text
    moment = datetime.fromisoformat(text)
    assert moment.tzinfo is not None
    assert moment.utcoffset() == timedelta(0)
    return moment


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@pytest.fixture
def outbox(backend):
    """Messages in three categories and five statuses, a failure with a multi-line error, an
    attempt, and three relays registered out of id order."""
    engine = backend.engine
    now = datetime.now(UTC)
    with Session(engine) as session:
        ids = [
            OB.enqueue(
                session,
                Email(
                    sender="shop@example.com", to=[f"c{i}@example.com"], subject=f"S{i}", text="t"
                ),
                key=f"out:{i}",
                category=category,
            ).id
            for i, category in enumerate(
                ["zeta", "receipts", "receipts", "receipts", "receipts", "receipts", "alpha"]
            )
        ]
        session.commit()
    changes: list[tuple[list[int], dict[str, Any]]] = [
        ([ids[2]], {"status": "unknown_outcome", "claimed_by": "r-a", "send_started_at": now}),
        (
            [ids[3]],
            {
                "status": "failed",
                "last_error_code": "MessageRejected",
                "last_error_message": MULTI_LINE_ERROR,
            },
        ),
        ([ids[4]], {"status": "sent", "sent_at": now, "provider_message_id": "ses-4"}),
        ([ids[5]], {"status": "retrying", "next_attempt_at": now + timedelta(hours=1)}),
        ([ids[6]], {"status": "failed", "last_error_code": None}),
    ]
    with engine.begin() as conn:
        for chosen, values in changes:
            conn.execute(messages.update().where(messages.c.id.in_(chosen)).values(**values))
        conn.execute(
            attempts.insert().values(
                message_id=ids[3],
                relay_id="r-a",
                started_at=now - timedelta(seconds=2),
                finished_at=now,
                outcome="failed",
                error_code="MessageRejected",
                error_message=MULTI_LINE_ERROR,
            )
        )
        for relay_id in ("r-z", "r-a", "r-m"):
            conn.execute(
                relays.insert().values(
                    relay_id=relay_id,
                    host="h",
                    pid=7,
                    started_at=now - timedelta(minutes=1),
                    heartbeat_at=now - timedelta(seconds=3),
                    state="running",
                )
            )
    return ids


def stored(engine: sa.Engine, column: sa.Column[Any], message_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(column).where(messages.c.id == message_id)).scalar_one()


def test_status_json_has_numbers_utc_times_and_a_stable_order(backend, outbox):
    before = datetime.now(UTC) - timedelta(minutes=5)
    report = json.loads(cli(backend, "status", "--json"))
    after = datetime.now(UTC) + timedelta(seconds=5)

    assert [(r["category"], r["status"]) for r in report["status_summary"]] == [
        ("alpha", "failed"),
        ("receipts", "pending"),
        ("receipts", "retrying"),
        ("receipts", "sent"),
        ("receipts", "failed"),
        ("receipts", "unknown_outcome"),
        ("zeta", "pending"),
    ], "by category, then statuses in the order of a message's life"
    for row in report["status_summary"]:
        assert type(row["message_count"]) is int
        assert before <= utc_time(row["oldest_created_at"]) <= after
        utc_time(row["oldest_next_attempt_at"])
    zeta = report["status_summary"][-1]
    assert utc_time(zeta["oldest_created_at"]) == stored(
        backend.engine, messages.c.created_at, outbox[0]
    ), "the stored instant, not shifted by a zone"

    assert [r["category"] for r in report["lag"]] == ["receipts", "zeta"]
    for row in report["lag"]:
        assert type(row["due_count"]) is int
        assert is_number(row["lag_seconds"])
        assert isinstance(row["lag_seconds"], float)
        assert 0 <= row["lag_seconds"] < 600
        assert before <= utc_time(row["oldest_due_at"]) <= after

    assert [(r["category"], r["error_code"]) for r in report["failures"]] == [
        ("alpha", None),
        ("receipts", "MessageRejected"),
    ]
    assert report["failures"][0]["newest_error_message"] is None
    assert report["failures"][1]["newest_error_message"] == MULTI_LINE_ERROR
    for row in report["failures"]:
        assert type(row["message_count"]) is int
        assert type(row["newest_message_id"]) is int
        utc_time(row["newest_at"])

    assert [r["relay_id"] for r in report["relay_health"]] == ["r-a", "r-m", "r-z"]
    for row in report["relay_health"]:
        assert type(row["pid"]) is int
        assert isinstance(row["heartbeat_age_seconds"], float)
        assert 2 <= row["heartbeat_age_seconds"] < 600
        assert utc_time(row["started_at"]) < utc_time(row["heartbeat_at"])
    assert type(report["unknown_outcomes"]) is int


def text_times(text: str) -> list[str]:
    """Every timestamp-looking string in ``text``, each checked to be the text output's form."""
    found = [m.group() for m in ANY_TIME.finditer(text)]
    for moment in found:
        assert TEXT_TIME.fullmatch(moment), f"{moment!r} is not UTC with Z to the second"
    return found


def table_rows(text: str, title: str) -> list[list[str]]:
    """The cells of the table under ``title`` (header left out)."""
    block = text.split(title + "\n", 1)[1].split("\n\n", 1)[0]
    return [line.split() for line in block.splitlines()[1:]]


def test_status_text_has_utc_times_with_z_and_the_json_order(backend, outbox):
    text = cli(backend, "status")
    assert len(text_times(text)) >= 7 + 2 + 2, text
    assert [row[:2] for row in table_rows(text, "Messages by status and category")] == [
        ["alpha", "failed"],
        ["receipts", "pending"],
        ["receipts", "retrying"],
        ["receipts", "sent"],
        ["receipts", "failed"],
        ["receipts", "unknown_outcome"],
        ["zeta", "pending"],
    ]
    assert [row[0] for row in table_rows(text, "Relays")] == ["r-a", "r-m", "r-z"]
    for row in table_rows(text, "Relays"):
        assert re.fullmatch(r"\d+\.\d", row[-1]), row  # age to a tenth of a second


def test_list_json_is_by_id_with_numbers_utc_times_and_nulls(backend, outbox):
    rows = json.loads(cli(backend, "list", "--json"))
    assert [r["id"] for r in rows] == sorted(outbox)
    for row in rows:
        assert type(row["id"]) is int
        assert type(row["attempt_count"]) is int
        assert type(row["priority"]) is int
        for name in ("created_at", "updated_at", "next_attempt_at"):
            utc_time(row[name])
    assert utc_time(rows[0]["created_at"]) == stored(
        backend.engine, messages.c.created_at, outbox[0]
    )
    assert "last_error_code" in rows[0]
    assert rows[0]["last_error_code"] is None
    page = json.loads(cli(backend, "list", "--limit", "2", "--after-id", str(outbox[1]), "--json"))
    assert [r["id"] for r in page] == outbox[2:4]


def test_list_text_has_utc_times_with_z(backend, outbox):
    text = cli(backend, "list")
    assert len(text_times(text)) == len(outbox)  # next_attempt_at of each
    assert [int(line.split()[0]) for line in text.splitlines()[1:]] == sorted(outbox)


def test_show_json_has_utc_times_numbers_and_nulls(backend, outbox):
    shown = json.loads(cli(backend, "show", str(outbox[3]), "--json"))
    message, (attempt,) = shown["message"], shown["attempts"]
    assert message["last_error_message"] == MULTI_LINE_ERROR
    assert message["sent_at"] is None
    assert message["expires_at"] is None
    assert isinstance(message["backoff_base"], float)
    assert type(message["max_attempts"]) is int
    assert utc_time(message["created_at"]) == stored(
        backend.engine, messages.c.created_at, outbox[3]
    )
    assert utc_time(attempt["started_at"]) < utc_time(attempt["finished_at"])
    assert attempt["provider_message_id"] is None
    sent = json.loads(cli(backend, "show", str(outbox[4]), "--json"))["message"]
    assert utc_time(sent["sent_at"]) <= datetime.now(UTC)


def test_show_text_keeps_each_value_on_its_line_with_utc_times(backend, outbox):
    text = cli(backend, "show", str(outbox[3]))
    text_times(text)
    fields = dict(
        line.split(None, 1) for line in text.split("\n\n", 1)[0].splitlines() if " " in line
    )
    assert fields["last_error_message"] == 'connection reset\\nDETAIL:  "peer" went away'
    assert TEXT_TIME.fullmatch(fields["created_at"])
    attempt_rows = text.split("attempts (1)\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert len(attempt_rows) == 2, "header and one row: the error did not split the row"
    assert len(TEXT_TIME.findall(attempt_rows[1])) == 2


@pytest.mark.parametrize("dry_run", [True, False])
def test_prune_says_its_cutoff_in_utc_with_z(backend, outbox, dry_run):
    text = cli(backend, "prune", "--older-than", "1d", *(["--dry-run"] if dry_run else []))
    # the row cutoff (the 30-day dedup window wins over --older-than), then the bodies'
    # (sent and the like after 7 days, failed after 30)
    moments = [datetime.fromisoformat(m) for m in text_times(text)]
    now = datetime.now(UTC)
    expected = [now - timedelta(days=d) for d in (30, 7, 30)]
    assert len(moments) == len(expected)
    for moment, wanted in zip(moments, expected, strict=True):
        assert abs(moment - wanted) < timedelta(minutes=5)
