"""How the relay writes values for people and machines: the one place that turns what a
database driver or a log call hands over into JSON-ready values and text.

The drivers disagree: PostgreSQL returns ``timestamptz`` in the session's zone and ``numeric``
as ``Decimal``; MariaDB returns naive ``DATETIME`` and ``Decimal`` for divisions; SQLite
returns what it stored. By the project's convention (``outbox.schema.UTCDateTime``) every
timestamp is UTC, so a naive one is read as UTC. Out of here:

* a timestamp is ISO 8601 in UTC ending in ``Z`` (``2026-12-01T12:00:00.123456Z``);
* a ``Decimal`` is a JSON number: an int when its type has no fraction (``Decimal('3')``), a
  float when it has one (``Decimal('0.0116')``), so a column keeps one type;
* a NaN or infinity (not JSON) is None;
* sets, tuples and lists are lists, mappings are dicts with string keys, anything else
  unknown is its ``str()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any, Literal

__all__ = ["TimeSpec", "plain", "utc_iso"]

TimeSpec = Literal["seconds", "milliseconds", "microseconds"]


def utc_iso(moment: datetime, timespec: TimeSpec = "microseconds") -> str:
    """``moment`` in UTC as ISO 8601 with a ``Z``; a naive ``moment`` is taken as UTC."""
    aware = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    return aware.replace(tzinfo=None).isoformat(sep="T", timespec=timespec) + "Z"


def _number(value: Decimal | float) -> int | float | None:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if not value.is_finite():
        return None
    exponent = value.as_tuple().exponent
    return int(value) if isinstance(exponent, int) and exponent >= 0 else float(value)


def plain(value: Any) -> Any:
    """``value`` made of JSON's own types only (None, bool, int, float, str, list, dict)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float | Decimal):
        return _number(value)
    if isinstance(value, datetime):
        return utc_iso(value)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, set | frozenset):
        items = [plain(item) for item in value]
        try:
            return sorted(items)
        except TypeError:  # mixed types: any order is as good
            return items
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return str(value)
