"""The relay's log lines: key=value text (default) or JSON, recipients masked, bodies never."""

from __future__ import annotations

import io
import json
import logging
import re
from datetime import UTC, datetime, timedelta

import pytest

from relay import logs

SECRET_BODY = "Your password reset code is 123456"


@pytest.fixture
def relay_logging():
    """Restore the ``relay`` logger after a test that configures it."""
    root = logging.getLogger("relay")
    saved = (root.handlers[:], root.level, root.propagate)
    yield
    root.handlers[:], root.level, root.propagate = saved


def lines_of(fmt: str, emit, **options) -> list[str]:
    stream = io.StringIO()
    logs.configure("DEBUG", fmt, stream=stream, **options)
    emit(logging.getLogger("relay.worker"))
    return stream.getvalue().splitlines()


def sent_line(log: logging.Logger) -> None:
    log.info(
        "sent %s",
        "now",
        extra={
            "action": "sent",
            "message_id": 42,
            "code": None,
            "to": ["alice@example.com", "Bob Smith <bob@shop.example.org>"],
            "cc": "carol@example.net",
            "recipients": "dave@example.com, erin@example.com",
            "recipient": "frank@example.com",
            "bcc": [],
            "text": SECRET_BODY,
            "html": f"<p>{SECRET_BODY}</p>",
            "body": SECRET_BODY,
            "payload": {"text": SECRET_BODY},
            "provider_message_id": "ses-1",
        },
    )


def test_json_lines_parse_and_carry_every_field(relay_logging):
    before = datetime.now(UTC) - timedelta(seconds=1)
    (line,) = lines_of("json", sent_line)
    doc = json.loads(line)
    assert list(doc)[:6] == ["ts", "level", "logger", "msg", "action", "message_id"]
    ts = datetime.fromisoformat(doc.pop("ts"))
    assert ts.utcoffset() == timedelta(0)
    assert before <= ts <= datetime.now(UTC)
    assert doc == {
        "level": "INFO",
        "logger": "relay.worker",
        "msg": "sent now",
        "action": "sent",
        "message_id": 42,
        "to": ["a***@example.com", "b***@shop.example.org"],
        "cc": "c***@example.net",
        "recipients": "d***@example.com, e***@example.com",
        "recipient": "f***@example.com",
        "bcc": [],
        "provider_message_id": "ses-1",
    }


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_bodies_are_never_logged_and_recipients_are_masked(relay_logging, fmt):
    (line,) = lines_of(fmt, sent_line)
    assert "123456" not in line
    for name in ("alice", "Bob Smith", "bob@", "carol", "dave", "erin", "frank"):
        assert name not in line


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_log_recipients_shows_the_addresses(relay_logging, fmt):
    (line,) = lines_of(fmt, sent_line, log_recipients=True)
    assert "alice@example.com" in line
    assert "dave@example.com, erin@example.com" in line
    assert "123456" not in line, "bodies stay out even then"


def test_json_exception_is_one_line_under_exc(relay_logging):
    def emit(log):
        try:
            raise RuntimeError("provider went away")
        except RuntimeError:
            log.exception("sender raised", extra={"action": "sender_error", "message_id": 7})

    (line,) = lines_of("json", emit)
    doc = json.loads(line)
    assert (doc["level"], doc["action"], doc["message_id"]) == ("ERROR", "sender_error", 7)
    assert doc["exc"].startswith("Traceback (most recent call last):")
    assert doc["exc"].endswith("RuntimeError: provider went away")


def test_json_keeps_clashing_and_odd_extras(relay_logging):
    when = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)

    def emit(log):
        log.warning(
            "odd",
            extra={
                "action": "x",
                "level": "mine",
                "ts": 1,
                "when": when,
                "ids": {3},
                "obj": object,
            },
        )

    doc = json.loads(lines_of("json", emit)[0])
    assert (doc["level"], doc["level_"], doc["ts_"]) == ("WARNING", "mine", 1)
    assert doc["when"] == "2026-11-29T12:00:00+00:00"
    assert doc["ids"] == [3]
    assert doc["obj"] == "<class 'object'>"


def test_text_format_is_unchanged(relay_logging):
    def emit(log):
        log.info("sent", extra={"action": "sent", "message_id": 42, "code": None, "swept": True})
        log.debug("claimed", extra={"count": 3, "action": "claimed"})
        log.warning("plain")

    lines = lines_of("text", emit)
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d"
    assert re.fullmatch(stamp + r" INFO action=sent message_id=42 swept=True sent", lines[0])
    assert re.fullmatch(stamp + r" DEBUG action=claimed count=3 claimed", lines[1])
    assert re.fullmatch(stamp + r" WARNING plain", lines[2])


def test_text_is_the_default_and_the_level_applies(relay_logging):
    stream = io.StringIO()
    logs.configure("warning", stream=stream)
    log = logging.getLogger("relay")
    log.info("hidden", extra={"action": "x"})
    log.warning("shown", extra={"action": "y"})
    assert stream.getvalue().endswith(" WARNING action=y shown\n")
    assert "hidden" not in stream.getvalue()
    assert log.propagate is False


def test_an_unknown_format_is_refused(relay_logging):
    with pytest.raises(ValueError, match="'xml'"):
        logs.configure(fmt="xml")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "masked"),
    [
        ("alice@example.com", "a***@example.com"),
        ("Alice <alice@example.com>", "a***@example.com"),
        ("a@b.example, c@d.example", "a***@b.example, c***@d.example"),
        (["x@y.example", ("z@w.example",)], ["x***@y.example", ["z***@w.example"]]),
        ("not an address", "***"),
        ("@example.com", "***"),
        ("", "***"),
        (3, 3),
        (None, None),
        (b"raw@example.com", "***"),
    ],
)
def test_mask_addresses(value, masked):
    assert logs.mask_addresses(value) == masked
