"""Log lines as ``key=value`` pairs: every relay line carries an ``action`` and, where there is
one, a ``message_id``; never a body or a credential."""

from __future__ import annotations

import logging
import sys

__all__ = ["KeyValueFormatter", "configure"]

_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    """``2026-11-29T12:00:00 INFO action=sent message_id=42 sent``"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(fields)s%(message)s", "%Y-%m-%dT%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        extra = {k: v for k, v in record.__dict__.items() if k not in _STANDARD and k != "fields"}
        ordered = sorted(extra.items(), key=lambda kv: (kv[0] != "action", kv[0] != "message_id"))
        record.fields = "".join(f"{k}={v} " for k, v in ordered if v is not None)
        return super().format(record)


def configure(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger("relay")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
