"""Fair sending, the app's side: each keyed message gets its turn (``fair_at``) when it is
written, a stride after the last queued message of its key, so keys are served in turn.

The claim reads due rows in (priority, ``fair_at``, id) order: a row's turn is never before
it is due (``next_attempt_at``), and a row with no key takes its turn when it is due, as
before keys existed. A key with 50,000 queued messages has turns one stride apart far into
the future; a key that enqueues one message now takes the next turn. Why the turn is set at
enqueue and not by the claim: docs/design.md, "Fair sending".
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from outbox.exceptions import ConfigurationError, InvalidArgument
from outbox.schema import Status, messages

__all__ = [
    "MAX_FAIRNESS_KEY_LENGTH",
    "STRIDE",
    "Weights",
    "assign_turns",
    "check_fairness_key",
    "from_domain",
]

MAX_FAIRNESS_KEY_LENGTH = 255
# The turns of one key's messages, at weight 1. Any stride longer than the time a message
# takes to send keeps keys apart; a long one only places a big backlog's last turns far out.
STRIDE = timedelta(seconds=1)
_WEIGHT_RANGE = (0.001, 1000.0)


_m = messages
# The latest turn in a key's line at one priority: ``line_at`` of its pending rows, the turn
# each took when it was written due. A row scheduled for later has none: it is not in line yet
# and must not push the key's mail behind it; nor must the key's mail of another priority,
# which is served apart. One backward seek of ix_outbox_messages_fairness.
_TAIL = (
    sa.select(_m.c.line_at)
    .where(
        _m.c.fairness_key == sa.bindparam("key", type_=_m.c.fairness_key.type),
        _m.c.status == sa.literal_column(f"'{Status.PENDING.value}'"),
        _m.c.priority == sa.bindparam("priority", type_=_m.c.priority.type),
        # an earlier turn would not move the new row's (its due time comes later)
        _m.c.line_at > sa.bindparam("floor", type_=_m.c.line_at.type),
    )
    .order_by(_m.c.line_at.desc())
    .limit(1)
)


_TAKE_WRITE_LOCK = sa.update(_m).where(sa.false()).values(id=_m.c.id)


def check_fairness_key(value: object, field: str = "fairness_key") -> str | None:
    """``value`` if it is a usable key (None: no key); else InvalidArgument naming ``field``."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgument(field, f"must be a string or None, not {type(value).__name__}")
    if not value.strip():
        raise InvalidArgument(field, "must not be empty (None for no key)")
    if not value.isprintable():
        raise InvalidArgument(field, f"{value!r} must be printable text (no control characters)")
    if value != value.strip():
        # MariaDB compares text ignoring trailing spaces: "acme" and "acme " would be one key
        raise InvalidArgument(field, f"{value!r} must not begin or end with whitespace")
    if len(value) > MAX_FAIRNESS_KEY_LENGTH:
        raise InvalidArgument(
            field, f"is {len(value)} characters long; the limit is {MAX_FAIRNESS_KEY_LENGTH}"
        )
    return value


def from_domain(email: Any) -> str:
    """The From address's domain, lower case: a category's ``fairness_key`` that gives each
    sending domain its turn (``Category(name=..., fairness_key=from_domain)``)."""
    address = str(email.sender).rsplit("<", 1)[-1].rstrip(">").strip()
    return address.rpartition("@")[2].lower()


class Weights:
    """How many turns a key gets for one of a weight-1 key's: ``{pattern: weight}``, the first
    pattern (``fnmatch``, case-sensitive) that matches a key wins; unmatched keys weigh 1."""

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.rules: list[tuple[str, float]] = []
        if weights is None:
            return
        if not isinstance(weights, Mapping):
            raise ConfigurationError("fairness_weights", "must be a mapping of pattern to weight")
        low, high = _WEIGHT_RANGE
        for pattern, weight in weights.items():
            if not isinstance(pattern, str) or not pattern:
                raise ConfigurationError("fairness_weights", f"{pattern!r} is not a key pattern")
            if (
                isinstance(weight, bool)
                or not isinstance(weight, int | float)
                or not math.isfinite(weight)
                or not low <= weight <= high
            ):
                raise ConfigurationError(
                    f"fairness_weights[{pattern!r}]", f"must be a number from {low:g} to {high:g}"
                )
            self.rules.append((pattern, float(weight)))

    def stride(self, key: str) -> timedelta:
        for pattern, weight in self.rules:
            if fnmatch.fnmatchcase(key, pattern):
                return STRIDE / weight
        return STRIDE


def assign_turns(
    conn: sa.Connection,
    rows: Sequence[dict[str, Any]],
    weights: Weights,
    *,
    existing: Callable[[list[str]], Collection[str]] = lambda keys: (),
) -> None:
    """Set ``fair_at`` on the keyed ``rows`` (in place, in order): a stride after the latest
    turn in their key's line at their priority that ``conn`` sees (this batch's included),
    and never before the row is due. One query per key and priority of the batch; none when
    no row has a key. A row whose idempotency key ``existing`` finds (a duplicate: not
    written) takes no turn; it is asked only when more than one row has a key.

    Two transactions enqueueing for one key at once do not see each other's rows, so their
    messages may share turns: the key then goes faster by that many, never slower."""
    lines: dict[tuple[str, int], datetime] = {}  # (key, priority) -> the latest due time
    for row in rows:
        if (key := row.get("fairness_key")) is not None:
            line = (key, row["priority"])
            lines[line] = max(lines.get(line, row["next_attempt_at"]), row["next_attempt_at"])
    if not lines:
        return
    if conn.dialect.name == "sqlite":
        # take the write lock before reading: a transaction that read a table first cannot
        # wait for another writer's lock, SQLite refuses it at once ("database is locked")
        conn.execute(_TAKE_WRITE_LOCK)
    keyed = [row["idempotency_key"] for row in rows if row.get("fairness_key") is not None]
    skip = set(existing(keyed)) if len(keyed) > 1 else set()
    tails: dict[tuple[str, int], datetime | None] = {
        (key, priority): conn.execute(
            _TAIL,
            {"key": key, "priority": priority, "floor": due - weights.stride(key)},
        ).scalar()
        for (key, priority), due in lines.items()
    }
    for row in rows:
        key = row.get("fairness_key")
        if key is None or row["idempotency_key"] in skip:
            continue
        line = (key, row["priority"])
        due: datetime = row["next_attempt_at"]
        tail = tails[line]
        turn = due if tail is None else max(due, tail + weights.stride(key))
        row["fair_at"] = tails[line] = turn
        if due <= row["created_at"]:  # written due: in its key's line from now on
            row["line_at"] = turn
