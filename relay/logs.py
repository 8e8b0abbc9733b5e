"""Log lines as logfmt (``text``, the default) or one JSON object per line (``json``).

Every relay line carries an ``action`` and, where there is one, a ``message_id``; never a body
or a credential. Both formats drop any field named ``text``, ``html``, ``body`` or ``payload``
(a body must never reach a log, even by mistake), and mask the addresses in fields named
``recipients``, ``recipient``, ``to``, ``cc``, ``bcc``, ``reply_to``, ``sender`` or ``from``
(``a***@example.com``) unless ``log_recipients`` is set; names match in any case, also inside
a dict or list value.

Both formats have one record per line, whatever a message or a traceback holds, and the same
keys: ``ts`` (ISO 8601 in UTC, ``Z``, milliseconds), ``level``, ``logger``, the extra fields
(``action`` and ``message_id`` first), ``msg``, then ``exc`` (a traceback) and ``stack``. An
extra field named like one of those fixed keys gets a trailing ``_`` (more, if that name is
taken too). Values are written by
:func:`relay.formats.plain` (timestamps in UTC with ``Z``, ``Decimal`` as a number).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from email.utils import getaddresses
from typing import Any, Literal, TextIO

from relay.formats import plain, utc_iso

__all__ = ["JsonFormatter", "KeyValueFormatter", "configure", "logfmt_value", "mask_addresses"]

_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}
_BODY_FIELDS = frozenset({"text", "html", "body", "payload"})
_ADDRESS_FIELDS = frozenset(
    {"recipients", "recipient", "to", "cc", "bcc", "reply_to", "reply-to", "sender", "from"}
)
_RESERVED = frozenset({"ts", "level", "logger", "msg", "exc", "stack"})


def _mask_one(address: str) -> str:
    local, at, domain = address.rpartition("@")
    if not at or not local or not domain:
        return "***"
    return f"{local[0]}***@{domain}"


def mask_addresses(value: Any) -> Any:
    """``alice@example.com`` -> ``a***@example.com``; a string of several addresses (display
    names are dropped, they are personal data too), or a list of them, is masked item by item.
    Numbers (a recipient count) and None pass through."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        parsed = [addr for _name, addr in getaddresses([value]) if addr]
        return ", ".join(_mask_one(a) for a in parsed) if parsed else "***"
    if isinstance(value, Iterable) and not isinstance(value, bytes | bytearray):
        return [mask_addresses(item) for item in value]
    return "***"


def _is_body(key: object) -> bool:
    return str(key).lower() in _BODY_FIELDS


def _scrubbed(key: object, value: Any, *, log_recipients: bool) -> Any:
    """``value`` of the field ``key`` with the addresses masked (unless ``log_recipients``)
    and, at any depth of mappings and lists, the body fields dropped and the address fields
    masked: a message's fields logged as one dict must not carry its body or its addresses
    either. Field names match in any case (``To`` as a header is named)."""
    if str(key).lower() in _ADDRESS_FIELDS and not log_recipients:
        return mask_addresses(value)
    if isinstance(value, Mapping):
        return {
            k: _scrubbed(k, v, log_recipients=log_recipients)
            for k, v in value.items()
            if not _is_body(k)
        }
    if isinstance(value, list | tuple):
        return [_scrubbed(None, item, log_recipients=log_recipients) for item in value]
    return value


def _extra_fields(record: logging.LogRecord, *, log_recipients: bool) -> dict[str, Any]:
    """The record's extra fields, ``action`` and ``message_id`` first, bodies dropped,
    addresses masked, None values left out."""
    fields: dict[str, Any] = {}
    for key, value in record.__dict__.items():
        if key in _STANDARD or key == "fields" or _is_body(key) or value is None:
            continue
        fields[key] = _scrubbed(key, value, log_recipients=log_recipients)
    ordered = sorted(fields.items(), key=lambda kv: (kv[0] != "action", kv[0] != "message_id"))
    return dict(ordered)


def _timestamp(record: logging.LogRecord) -> str:
    return utc_iso(datetime.fromtimestamp(record.created, UTC), "milliseconds")


def _fields(
    formatter: logging.Formatter, record: logging.LogRecord, *, log_recipients: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    """The record's extra fields, plain (see :func:`relay.formats.plain`) and renamed off the
    fixed keys, and its trailing ``exc`` and ``stack`` texts, if any."""
    fields = _extra_fields(record, log_recipients=log_recipients)
    extra: dict[str, Any] = {}
    for key, value in fields.items():
        name = key
        while name in _RESERVED or name in extra or (name != key and name in fields):
            name += "_"  # a renamed field never overwrites one given under its new name
        extra[name] = plain(value)
    tail: dict[str, str] = {}
    if record.exc_info:
        record.exc_text = record.exc_text or formatter.formatException(record.exc_info)
    if record.exc_text:
        tail["exc"] = record.exc_text
    if record.stack_info:
        tail["stack"] = formatter.formatStack(record.stack_info)
    return extra, tail


_LOGFMT_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


# ASCII text that logfmt takes bare: printable, no space, '=', '"' or '\\' (what
# _needs_quotes refuses, for ASCII); one regex match instead of a test per character
_BARE_ASCII = re.compile(r"[\x21\x23-\x3c\x3e-\x5b\x5d-\x7e]+")


def _bare(text: str) -> bool:
    """True if ``text`` needs no quotes (not empty, no character :func:`_needs_quotes`)."""
    if text.isascii():
        return _BARE_ASCII.fullmatch(text) is not None
    return bool(text) and not any(_needs_quotes(c) for c in text)


def _logfmt_key(name: str) -> str:
    """A key logfmt can hold: no space, ``=``, ``"`` or unprintable character (each becomes
    ``_``), never empty."""
    if _bare(name):
        return name
    cleaned = "".join("_" if _needs_quotes(c) else c for c in name)
    return cleaned or "_"


def _needs_quotes(char: str) -> bool:
    return char in ' ="\\' or not char.isprintable()


def _escape(char: str) -> str:
    """One character inside a quoted value, escaped as in a JSON string (what logfmt parsers
    decode): short escapes, ``\\uXXXX`` (a surrogate pair past the BMP) for the unprintable.
    A lone surrogate (undecodable bytes let in by ``surrogateescape``) has no UTF-8 form: it
    is written as U+FFFD, as any UTF-8 log pipeline would."""
    if char in _LOGFMT_SHORT_ESCAPES:
        return _LOGFMT_SHORT_ESCAPES[char]
    if char.isprintable():
        return char
    code = ord(char)
    if 0xD800 <= code <= 0xDFFF:
        return "\ufffd"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def logfmt_value(value: Any) -> str:
    """``value`` (plain) as a logfmt value: bare when it can be, else quoted and escaped; lists
    are joined with ``, ``, mappings written as JSON."""
    if value is True or value is False:
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    elif isinstance(value, list):
        text = ", ".join(item if isinstance(item, str) else json.dumps(item) for item in value)
    elif isinstance(value, dict):
        text = json.dumps(value, ensure_ascii=False)
    else:
        text = str(value)
    if _bare(text):
        return text
    return '"' + "".join(_escape(c) for c in text) + '"'


class KeyValueFormatter(logging.Formatter):
    """One logfmt line per record::

        ts=2026-12-01T12:00:00.123Z level=info logger=relay action=sent message_id=42 msg=sent

    Keys in the order of the module docstring; ``level`` in lower case as logfmt tools expect.
    A value with a space, ``=``, ``"``, ``\\`` or an unprintable character is quoted, with
    ``"`` and ``\\`` escaped and newlines as ``\\n``, so a driver's multi-line error or a
    traceback (``exc``) stays on its line.
    """

    def __init__(self, *, log_recipients: bool = False) -> None:
        super().__init__()
        self.log_recipients = log_recipients

    def format(self, record: logging.LogRecord) -> str:
        extra, tail = _fields(self, record, log_recipients=self.log_recipients)
        pairs: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        for key, value in extra.items():
            name = _logfmt_key(key)
            while name in pairs or name in _RESERVED or name in tail:
                name += "_"  # two names made safe alike ("a key", "a_key") stay two keys
            pairs[name] = value
        pairs.update({"msg": record.getMessage(), **tail})
        return " ".join(f"{k}={logfmt_value(v)}" for k, v in pairs.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line::

        {"ts": "2026-11-29T12:00:00.123Z", "level": "INFO", "logger": "relay",
         "msg": "sent", "action": "sent", "message_id": 42}

    ``ts`` is ISO-8601 in UTC; every extra field that is not None follows (one whose name
    clashes with a fixed key gets a trailing ``_``); an exception's traceback is under ``exc``.
    """

    def __init__(self, *, log_recipients: bool = False) -> None:
        super().__init__()
        self.log_recipients = log_recipients

    def format(self, record: logging.LogRecord) -> str:
        extra, tail = _fields(self, record, log_recipients=self.log_recipients)
        doc: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **extra,
            **tail,
        }
        return json.dumps(doc, ensure_ascii=True)


def configure(
    level: str = "INFO",
    fmt: Literal["text", "json"] = "text",
    log_recipients: bool = False,
    *,
    stream: TextIO | None = None,
) -> None:
    """Send the ``relay`` loggers' lines to ``stream`` (stderr) as ``text`` (logfmt) or
    ``json`` lines. Recipients are masked unless ``log_recipients``."""
    formatter: logging.Formatter
    if fmt == "text":
        formatter = KeyValueFormatter(log_recipients=log_recipients)
    elif fmt == "json":
        formatter = JsonFormatter(log_recipients=log_recipients)
    else:
        raise ValueError(f"log format {fmt!r}: expected 'text' or 'json'")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger("relay")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
