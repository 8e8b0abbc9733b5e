"""How the operator commands write what they found: values that keep to their line, aligned
tables, ``--json``, the detail of a log row, and long lists cut short."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from relay.formats import plain, utc_iso

__all__ = ["detail", "escaped", "some", "table", "text", "to_json"]


def escaped(value: str, keep: str = "") -> str:
    """``value`` with its control characters (but those in ``keep``) written as escapes, so
    a driver's multi-line error keeps to its line."""
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in value)


def text(value: Any) -> str:
    """One value as the text output shows it: a timestamp in UTC to the second with ``Z``
    (``2026-12-01T12:00:00Z``, as in the logs and ``--json``), a number as itself, None as
    nothing, a list joined with ``, ``; control characters escaped."""
    if isinstance(value, datetime):
        return utc_iso(value, "seconds")
    value = plain(value)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(text(item) for item in value)
    return escaped(json.dumps(value) if isinstance(value, dict) else str(value))


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Rows as aligned columns; ages (floats) to a tenth of a second, long text cut at 48."""

    def cell(value: Any) -> str:
        number = plain(value) if isinstance(value, float | Decimal) else None
        if isinstance(number, float):
            return f"{number:.1f}"
        shown = text(value)
        return shown if len(shown) <= 48 else shown[:45] + "..."

    cells = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def to_json(value: Any) -> str:
    """``value`` as the commands' ``--json`` prints it: indented, keys sorted, made plain by
    :func:`relay.formats.plain` (timestamps ISO 8601 in UTC with ``Z``, numbers as numbers,
    None as null)."""
    return json.dumps(plain(value), indent=2, sort_keys=True)


def detail(**fields: Any) -> str:
    """The ``detail`` of a log row: its facts as compact JSON, keys sorted."""
    return json.dumps(plain(fields), sort_keys=True, separators=(",", ":"))


def some(items: Iterable[str], shown: int = 10) -> str:
    """The first ``shown`` items and how many more: a refusal of 70,000 ids stays one line."""
    listed = list(items)
    more = f" and {len(listed) - shown} more" if len(listed) > shown else ""
    return ", ".join(listed[:shown]) + more
