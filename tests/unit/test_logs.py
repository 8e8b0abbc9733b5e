"""The relay's log lines: logfmt text (default) or JSON, recipients masked, bodies never."""

from __future__ import annotations

import io
import json
import logging
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from zoneinfo import ZoneInfo

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from relay import logs
from tests.support.logfmt import LogfmtError, parse, parse_pairs

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
    assert doc["when"] == "2026-11-29T12:00:00.000000Z"  # UTC with Z, as everywhere
    assert doc["ids"] == [3]
    assert doc["obj"] == "<class 'object'>"


def nested_fields_line(log: logging.Logger) -> None:
    log.warning(
        "message as a dict",
        extra={
            "action": "x",
            "email": {
                "subject": "Hi",
                "text": SECRET_BODY,
                "To": "Alice Smith <alice@example.com>",
                "parts": [{"html": f"<p>{SECRET_BODY}</p>", "cc": ["carol@example.net"]}],
            },
            "Body": SECRET_BODY,
        },
    )


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_bodies_and_addresses_nested_in_a_field_are_dropped_and_masked(relay_logging, fmt):
    """A dict of a message's fields logged whole (by a custom sender, a signal handler) must
    not carry its body or its addresses either, whatever the case of their names."""
    (line,) = lines_of(fmt, nested_fields_line)
    assert "123456" not in line
    for name in ("alice", "Alice Smith", "carol"):
        assert name not in line
    assert "a***@example.com" in line
    assert "c***@example.net" in line
    if fmt == "json":
        assert json.loads(line)["email"] == {
            "subject": "Hi",
            "To": "a***@example.com",
            "parts": [{"cc": ["c***@example.net"]}],
        }


@pytest.mark.parametrize("fmt", ["json", "text"])
@pytest.mark.parametrize("name", ["reply_to", "Reply-To", "sender", "From"])
def test_reply_to_and_sender_addresses_are_masked_too(relay_logging, fmt, name):
    (line,) = lines_of(fmt, lambda log: log.info("m", extra={name: "Alice <alice@example.com>"}))
    assert "alice" not in line
    assert "Alice" not in line
    assert "a***@example.com" in line


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_renamed_clashing_extra_never_overwrites_another_field(relay_logging, fmt):
    def emit(log):
        log.warning("m", extra={"ts": "mine", "ts_": "also mine", "level": 1, "level_": 2})

    (line,) = lines_of(fmt, emit)
    fields = json.loads(line) if fmt == "json" else parse(line)
    assert (fields["ts_"], fields["ts__"]) == ("also mine", "mine")
    assert (fields["level_"], fields["level__"]) == ((2, 1) if fmt == "json" else ("2", "1"))


STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def test_text_lines_are_logfmt_in_a_fixed_key_order(relay_logging):
    def emit(log):
        log.info("sent", extra={"action": "sent", "message_id": 42, "code": None, "swept": True})
        log.debug("claimed", extra={"count": 3, "action": "claimed"})
        log.warning("plain")

    lines = lines_of("text", emit)

    def head(level: str) -> str:
        return f"ts={STAMP} level={level} logger=relay.worker "

    assert re.fullmatch(head("info") + "action=sent message_id=42 swept=true msg=sent", lines[0])
    assert re.fullmatch(head("debug") + "action=claimed count=3 msg=claimed", lines[1])
    assert re.fullmatch(head("warning") + "msg=plain", lines[2])
    for line in lines:
        assert [k for k, _ in parse_pairs(line)][:3] == ["ts", "level", "logger"]


def test_text_timestamps_are_utc_with_a_zone(relay_logging):
    before = datetime.now(UTC) - timedelta(seconds=1)
    (line,) = lines_of("text", sent_line)
    ts = datetime.fromisoformat(parse(line)["ts"])
    assert ts.tzinfo is not None
    assert ts.utcoffset() == timedelta(0)
    assert before <= ts <= datetime.now(UTC)


def test_text_quotes_and_escapes_what_would_break_a_line(relay_logging):
    driver_error = 'server closed the connection\n\tDETAIL:  "x" = \\ y\r\n'

    def emit(log):
        log.error(
            "database error: %s",
            driver_error,
            extra={"action": "db_error", "scope": "identity:shop example", "empty": "", "n": 1.5},
        )

    (line,) = lines_of("text", emit)  # one line, though the message has three
    assert 'scope="identity:shop example"' in line
    assert 'msg="database error: server closed the connection\\n\\tDETAIL:  \\"x\\" = ' in line
    fields = parse(line)
    assert fields["msg"] == f"database error: {driver_error}"
    assert (fields["scope"], fields["empty"], fields["n"]) == ("identity:shop example", "", "1.5")


def test_text_traceback_stays_on_the_line_as_exc(relay_logging):
    def emit(log):
        try:
            raise RuntimeError("provider went away\nfor good")
        except RuntimeError:
            log.exception("sender raised", extra={"action": "sender_error", "message_id": 7})

    (line,) = lines_of("text", emit)
    fields = parse(line)
    assert list(fields)[-2:] == ["msg", "exc"]
    assert [fields[k] for k in ("level", "action", "message_id")] == ["error", "sender_error", "7"]
    assert fields["exc"].startswith("Traceback (most recent call last):\n")
    assert fields["exc"].endswith("RuntimeError: provider went away\nfor good")


def test_text_values_are_written_plain(relay_logging):
    when = datetime(2026, 11, 29, 13, 0, tzinfo=ZoneInfo("Europe/Berlin"))  # 12:00 UTC

    def emit(log):
        log.info(
            "odd",
            extra={
                "action": "x",
                "level": "mine",
                "when": when,
                "naive": datetime(2026, 11, 29, 12, 0),  # UTC by the project's convention
                "lag": Decimal("0.0116"),
                "count": Decimal("3"),
                "ids": {3, 1},
                "flag": False,
                "to": ["alice@example.com", "bob@example.com"],
            },
        )

    fields = parse(lines_of("text", emit)[0])
    assert (fields["level"], fields["level_"]) == ("info", "mine")
    assert fields["when"] == "2026-11-29T12:00:00.000000Z"
    assert fields["naive"] == "2026-11-29T12:00:00.000000Z"
    assert (fields["lag"], fields["count"], fields["flag"]) == ("0.0116", "3", "false")
    assert fields["ids"] == "1, 3"
    assert fields["to"] == "a***@example.com, b***@example.com"


def test_text_keys_logfmt_cannot_hold_are_made_safe(relay_logging):
    def emit(log):
        log.info("k", extra={"action": "x", "a key": 1, 'q"=k': 2, "tab\tkey": 3})

    fields = parse(lines_of("text", emit)[0])
    assert (fields["a_key"], fields["q__k"], fields["tab_key"]) == ("1", "2", "3")


def test_text_keys_made_safe_alike_stay_apart(relay_logging):
    def emit(log):
        log.info("k", extra={"action": "x", "a_key": 1, "a key": 2, "ms g": 3})

    fields = parse(lines_of("text", emit)[0])  # the strict parser refuses a key given twice
    assert {k: fields[k] for k in ("a_key", "a_key_", "ms_g", "msg")} == {
        "a_key": "1",
        "a_key_": "2",
        "ms_g": "3",
        "msg": "k",
    }


def test_a_lone_surrogate_is_written_as_the_replacement_character(relay_logging):
    def emit(log):
        log.info("path %s", "caf\udce9", extra={"action": "x"})

    (line,) = lines_of("text", emit)
    line.encode("utf-8")  # a lone surrogate would not encode
    assert parse(line)["msg"] == "path caf\ufffd"


@given(st.text(alphabet=st.characters(exclude_categories=("Cs",))))
@example("")
@example('\\"')
@example("\U000e0001 \x7f\x00")
def test_any_text_round_trips_through_a_logfmt_value(text):
    line = f"k={logs.logfmt_value(text)}"
    assert parse(line) == {"k": text}


_NAME = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True).filter(
    lambda k: (
        k not in logs._STANDARD
        and k not in logs._RESERVED
        and k not in logs._BODY_FIELDS
        and k not in logs._ADDRESS_FIELDS
    )
)


@given(
    message=st.text(alphabet=st.characters(exclude_categories=("Cs",))),
    fields=st.dictionaries(_NAME, st.text(alphabet=st.characters(exclude_categories=("Cs",)))),
)
def test_any_record_is_one_logfmt_line_that_reads_back(message, fields):
    formatter = logs.KeyValueFormatter()
    record = logging.makeLogRecord(
        {"name": "relay.worker", "levelno": 20, "levelname": "INFO", "msg": message, **fields}
    )
    line = formatter.format(record)
    assert len(line.splitlines()) == 1
    parsed = parse(line)
    assert parsed.pop("msg") == message
    assert {k: parsed.pop(k) for k in ("ts", "level", "logger")}.keys() == {"ts", "level", "logger"}
    assert parsed == fields


@pytest.mark.parametrize(
    "line",
    [
        "k=v ",
        "k=v  j=w",
        "k=",
        "=v",
        'k="unterminated',
        'k="bad \\q escape"',
        "k=a\tb",
        'k="v"j=w',
        "k=v k=w",
    ],
)
def test_the_strict_parser_refuses_what_is_not_logfmt(line):
    with pytest.raises(LogfmtError):
        parse(line)


def test_text_is_the_default_and_the_level_applies(relay_logging):
    stream = io.StringIO()
    logs.configure("warning", stream=stream)
    log = logging.getLogger("relay")
    log.info("hidden", extra={"action": "x"})
    log.warning("shown", extra={"action": "y"})
    assert stream.getvalue().endswith(" level=warning logger=relay action=y msg=shown\n")
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
