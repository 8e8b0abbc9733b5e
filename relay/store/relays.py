"""Who is alive: the relays' rows (register, heartbeat, stop) and the scoped pauses each row
shows, the count of live relays and intakes, and the bound on how long a silent intake replica
may still hold a message."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from outbox.schema import RelayState, intakes, relays

__all__ = [
    "BEAT_BEFORE_RECEIVE",
    "PAUSES_CHARS",
    "PAUSES_SHOWN",
    "RECEIVE_AFTER_HEARTBEAT",
    "PausedScope",
    "RelayHolder",
    "RelayPauses",
    "heartbeat_held",
    "live_heartbeats",
    "pauses_refused",
    "pauses_text",
    "read_pauses",
    "register",
    "relay_pauses",
    "stop_held",
]

# seconds after its last committed heartbeat that an intake replica may still be handed a
# message: the heartbeat is read before its batch commits, the replica beats again before a
# receive that would start later than BEAT_BEFORE_RECEIVE after that reading, and one long
# poll (20 s) and its answer fit in the rest
RECEIVE_AFTER_HEARTBEAT = 120.0
# seconds: the intake beats first rather than start a receive later than this after its last
# committed heartbeat's reading (relay.intake), which keeps RECEIVE_AFTER_HEARTBEAT true
BEAT_BEFORE_RECEIVE = RECEIVE_AFTER_HEARTBEAT / 2

_LIVE_STATES = (RelayState.RUNNING, RelayState.PAUSED, RelayState.DRAINING)

# A row lists at most PAUSES_SHOWN scoped pauses in at most PAUSES_CHARS characters and counts
# the rest: a storm of paused identities must not grow the row the relay rewrites every
# heartbeat (nor pass MariaDB's 64 KB TEXT). Each text is cut to _FIELD_CHARS (an address is
# at most 320); the JSON is ASCII (``\u`` escapes), so characters are bytes.
PAUSES_SHOWN = 100
PAUSES_CHARS = 16_000
_FIELD_CHARS = 320
_READ_CHARS = 65_536  # a longer value is not ours: unreadable, not parsed
_TIME = "%Y-%m-%dT%H:%M:%SZ"


@dataclass(frozen=True, kw_only=True, slots=True)
class PausedScope:
    """One scoped pause as a relay's row shows it: its scope (``kind``, ``name``, ``via`` as
    :class:`relay.pause.Scope` has them), the provider's ``code``, when it began (``since``)
    and when its next probe is due (``until``; None while a probe is out)."""

    kind: str
    name: str = ""
    via: str = ""
    code: str = ""
    since: datetime | None = None
    until: datetime | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RelayPauses:
    """A relay's scoped pauses as its row has them: those listed (``scopes``), how many more
    there were (``more``), or ``unreadable`` (a value this release cannot read: none listed)."""

    scopes: tuple[PausedScope, ...] = ()
    more: int = 0
    unreadable: bool = False

    @property
    def count(self) -> int:
        """Every scoped pause the row tells of, listed or not."""
        return len(self.scopes) + self.more


_UNREADABLE = RelayPauses(unreadable=True)


def _entry(scope: PausedScope) -> str:
    """One pause as compact JSON, empty and unknown fields left out."""
    item: dict[str, str] = {"kind": scope.kind[:_FIELD_CHARS], "name": scope.name[:_FIELD_CHARS]}
    if scope.via:
        item["via"] = scope.via[:_FIELD_CHARS]
    if scope.code:
        item["code"] = scope.code[:_FIELD_CHARS]
    for key, moment in (("since", scope.since), ("until", scope.until)):
        if moment is not None:
            aware = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment
            item[key] = aware.astimezone(UTC).strftime(_TIME)
    return json.dumps(item, separators=(",", ":"), ensure_ascii=True)


def pauses_text(scopes: Iterable[PausedScope]) -> str | None:
    """The ``paused_scopes`` value of a relay's row: ``{"scopes":[...],"more":n}`` (``more``
    only when some were left out), None when nothing is paused. Bounded: the first
    :data:`PAUSES_SHOWN` that fit in :data:`PAUSES_CHARS` characters are listed, the rest
    counted."""
    listed: list[str] = []
    size = len('{"scopes":[],"more":}') + 20  # the frame, and room for any count
    more = 0
    for scope in scopes:
        if more or len(listed) >= PAUSES_SHOWN:
            more += 1
            continue
        entry = _entry(scope)
        if size + len(entry) + 1 > PAUSES_CHARS:
            more += 1
            continue
        listed.append(entry)
        size += len(entry) + 1
    if not listed and not more:
        return None
    tail = f',"more":{more}' if more else ""
    return '{"scopes":[' + ",".join(listed) + "]" + tail + "}"


def _text(item: dict[str, Any], key: str) -> str:
    value = item.get(key, "")
    if not isinstance(value, str):
        raise ValueError(key)
    return value


def _moment(item: dict[str, Any], key: str) -> datetime | None:
    value = item.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(key)
    moment = datetime.fromisoformat(value)
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _scope(item: Any) -> PausedScope:
    """One listed pause read back (unknown keys ignored: a later release may add some);
    ValueError if it is not one."""
    if not isinstance(item, dict) or not _text(item, "kind"):
        raise ValueError("not a pause")
    return PausedScope(
        kind=_text(item, "kind"),
        name=_text(item, "name"),
        via=_text(item, "via"),
        code=_text(item, "code"),
        since=_moment(item, "since"),
        until=_moment(item, "until"),
    )


def read_pauses(text: str | None) -> RelayPauses:
    """A row's ``paused_scopes`` read back: none for NULL or empty, ``unreadable`` for anything
    :func:`pauses_text` would not have written (never an exception: a page shows it)."""
    if not text:
        return RelayPauses()
    if len(text) > _READ_CHARS:
        return _UNREADABLE
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or not isinstance(doc.get("scopes"), list):
            return _UNREADABLE
        more = doc.get("more", 0)
        if type(more) is not int or more < 0:
            return _UNREADABLE
        return RelayPauses(scopes=tuple(_scope(item) for item in doc["scopes"]), more=more)
    except (ValueError, OverflowError, RecursionError):  # not JSON, not a pause, not a time
        return _UNREADABLE


def relay_pauses(conn: sa.Connection) -> dict[str, RelayPauses]:
    """Each relay's scoped pauses by relay id (relays with none are left out)."""
    rows = conn.execute(
        sa.select(relays.c.relay_id, relays.c.paused_scopes).where(
            relays.c.paused_scopes.is_not(None)
        )
    )
    return {row.relay_id: read_pauses(row.paused_scopes) for row in rows}


@dataclass(frozen=True, kw_only=True, slots=True)
class RelayHolder:
    """The live relay that holds a relay id (see :func:`register`)."""

    host: str
    pid: int
    heartbeat_at: datetime
    state: str  # as read: a relay of another release may write a state this one lacks


def register(
    conn: sa.Connection,
    *,
    relay_id: str,
    host: str,
    pid: int,
    now: datetime,
    dead_after: float,
    unseen: Collection[datetime] = (),
    with_pauses: bool = True,
) -> RelayHolder | None:
    """Announce a relay, unless a live relay holds its id: None once registered, else the
    live holder (its row left as it is).

    A dead relay's row (stopped, or no heartbeat for ``dead_after`` seconds, on the database's
    clock) is taken over by one guarded UPDATE, so of two relays starting under one id only
    one takes it; two inserting a new id at once make the later fail on the key
    (``IntegrityError``: look again). ``unseen``: the ``started_at`` of this process's
    (``host``, ``pid``) earlier registers whose COMMIT it did not see; a row carrying one is
    its own, taken over like a dead one. ``with_pauses=False``: ``paused_scopes`` left
    alone, as :func:`heartbeat_held`.
    """
    values = {
        "host": host,
        "pid": pid,
        "started_at": now,
        "heartbeat_at": now,
        "state": RelayState.RUNNING.value,
    }
    if with_pauses:
        values["paused_scopes"] = None  # a dead relay's pauses are not this one's
    dead = sa.or_(
        relays.c.state.not_in(_LIVE_STATES),
        relays.c.heartbeat_at < now - timedelta(seconds=dead_after),
        sa.false()
        if not unseen
        else sa.and_(
            relays.c.host == host, relays.c.pid == pid, relays.c.started_at.in_(list(unseen))
        ),
    )
    take = sa.update(relays).where(relays.c.relay_id == relay_id, dead).values(values)
    taken = conn.execute(take)
    if taken.rowcount == 1:
        return None
    holder = conn.execute(
        sa.select(relays.c.host, relays.c.pid, relays.c.heartbeat_at, relays.c.state).where(
            relays.c.relay_id == relay_id
        )
    ).one_or_none()
    if holder is not None:
        return RelayHolder(
            host=holder.host, pid=holder.pid, heartbeat_at=holder.heartbeat_at, state=holder.state
        )
    conn.execute(sa.insert(relays).values(relay_id=relay_id, **values))
    return None


def _held(relay_id: str, host: str, pid: int, started_at: datetime) -> sa.ColumnElement[bool]:
    """The row this relay registered, and not one another relay with its id took over since."""
    return sa.and_(
        relays.c.relay_id == relay_id,
        relays.c.host == host,
        relays.c.pid == pid,
        relays.c.started_at == started_at,
    )


def heartbeat_held(
    conn: sa.Connection,
    *,
    relay_id: str,
    host: str,
    pid: int,
    started_at: datetime,
    now: datetime,
    state: RelayState,
    pauses: str | None = None,
    with_pauses: bool = True,
) -> bool:
    """The relay is alive, in ``state``, with its scoped ``pauses`` (:func:`pauses_text`;
    None: none; ``with_pauses=False``: the column left alone, for a role or a schema without
    it), on the row it registered at ``started_at``. False if that row is gone or was taken
    over (this relay looked dead)."""
    shown = {"paused_scopes": pauses} if with_pauses else {}
    stmt = (
        sa.update(relays)
        .where(_held(relay_id, host, pid, started_at))
        .values(heartbeat_at=now, state=state, **shown)
    )
    return conn.execute(stmt).rowcount == 1


def pauses_refused(exc: sa.exc.DBAPIError) -> bool:
    """Whether a heartbeat failed for want of ``paused_scopes``: the relay's role may not
    update it (a grant from before the column: PostgreSQL 42501, MariaDB 1142/1143) or the
    schema has no such column yet (42703, 1054, SQLite's "no such column": the relay
    deployed before the migration)."""
    orig = exc.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    args = getattr(orig, "args", ())
    return (
        code in ("42501", "42703")
        or bool(args and args[0] in (1054, 1142, 1143))
        or "no such column: paused_scopes" in str(orig)
    )


def stop_held(
    conn: sa.Connection,
    *,
    relay_id: str,
    host: str,
    pid: int,
    started_at: datetime,
    now: datetime,
    with_pauses: bool = True,
) -> None:
    """The relay exited cleanly (its own row only: never a successor's), its pauses cleared
    (unless ``with_pauses=False``, as :func:`heartbeat_held`)."""
    shown = {"paused_scopes": None} if with_pauses else {}
    conn.execute(
        sa.update(relays)
        .where(_held(relay_id, host, pid, started_at))
        .values(heartbeat_at=now, state=RelayState.STOPPED.value, **shown)
    )


def live_heartbeats(conn: sa.Connection, *, since: datetime) -> tuple[int, int]:
    """How many relays (``running``) and event intakes beat since ``since``: whether a test
    message can be sent and its events seen."""
    running = conn.execute(
        sa.select(sa.func.count())
        .select_from(relays)
        .where(relays.c.state == RelayState.RUNNING.value, relays.c.heartbeat_at >= since)
    ).scalar_one()
    taking = conn.execute(
        sa.select(sa.func.count()).select_from(intakes).where(intakes.c.heartbeat_at >= since)
    ).scalar_one()
    return int(running), int(taking)
