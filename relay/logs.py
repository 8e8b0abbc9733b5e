"""Log lines as ``key=value`` pairs (default) or one JSON object per line.

Every relay line carries an ``action`` and, where there is one, a ``message_id``; never a body
or a credential. Both formats drop any field named ``text``, ``html``, ``body`` or ``payload``
(a body must never reach a log, even by mistake), and mask the addresses in fields named
``recipients``, ``recipient``, ``to``, ``cc`` or ``bcc`` (``a***@example.com``) unless
``log_recipients`` is set.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable
from datetime import UTC, date, datetime
from email.utils import getaddresses
from typing import Any, Literal, TextIO

__all__ = ["JsonFormatter", "KeyValueFormatter", "configure", "mask_addresses"]

_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}
_BODY_FIELDS = frozenset({"text", "html", "body", "payload"})
_ADDRESS_FIELDS = frozenset({"recipients", "recipient", "to", "cc", "bcc"})
_JSON_RESERVED = frozenset({"ts", "level", "logger", "msg", "exc", "stack"})


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


def _extra_fields(record: logging.LogRecord, *, log_recipients: bool) -> dict[str, Any]:
    """The record's extra fields, ``action`` and ``message_id`` first, bodies dropped,
    addresses masked, None values left out."""
    fields: dict[str, Any] = {}
    for key, value in record.__dict__.items():
        if key in _STANDARD or key == "fields" or key in _BODY_FIELDS or value is None:
            continue
        if key in _ADDRESS_FIELDS and not log_recipients:
            value = mask_addresses(value)
        fields[key] = value
    ordered = sorted(fields.items(), key=lambda kv: (kv[0] != "action", kv[0] != "message_id"))
    return dict(ordered)


class KeyValueFormatter(logging.Formatter):
    """``2026-11-29T12:00:00 INFO action=sent message_id=42 sent``"""

    def __init__(self, *, log_recipients: bool = False) -> None:
        super().__init__("%(asctime)s %(levelname)s %(fields)s%(message)s", "%Y-%m-%dT%H:%M:%S")
        self.log_recipients = log_recipients

    def format(self, record: logging.LogRecord) -> str:
        extra = _extra_fields(record, log_recipients=self.log_recipients)
        record.fields = "".join(f"{k}={v} " for k, v in extra.items())
        return super().format(record)


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


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
        ts = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        doc: dict[str, Any] = {
            "ts": ts.replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _extra_fields(record, log_recipients=self.log_recipients).items():
            doc[f"{key}_" if key in _JSON_RESERVED else key] = value
        if record.exc_info:
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            doc["exc"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, default=_json_default)


def configure(
    level: str = "INFO",
    fmt: Literal["text", "json"] = "text",
    log_recipients: bool = False,
    *,
    stream: TextIO | None = None,
) -> None:
    """Send the ``relay`` loggers' lines to ``stream`` (stderr) as ``text`` (key=value) or
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
