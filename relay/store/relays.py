"""Who is alive: the relays' rows (register, heartbeat, stop), the count of live relays and
intakes, and the bound on how long a silent intake replica may still hold a message."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa

from outbox.schema import RelayState, intakes, relays

__all__ = [
    "BEAT_BEFORE_RECEIVE",
    "RECEIVE_AFTER_HEARTBEAT",
    "RelayHolder",
    "heartbeat_held",
    "live_heartbeats",
    "register",
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
) -> RelayHolder | None:
    """Announce a relay, unless a live relay holds its id: None once registered, else the
    live holder (its row left as it is).

    A dead relay's row (stopped, or no heartbeat for ``dead_after`` seconds, on the database's
    clock) is taken over by one guarded UPDATE, so of two relays starting under one id only
    one takes it; two inserting a new id at once make the later fail on the key
    (``IntegrityError``: look again). ``unseen``: the ``started_at`` of this process's
    (``host``, ``pid``) earlier registers whose COMMIT it did not see; a row carrying one is
    its own, taken over like a dead one.
    """
    values = {
        "host": host,
        "pid": pid,
        "started_at": now,
        "heartbeat_at": now,
        "state": RelayState.RUNNING.value,
    }
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
) -> bool:
    """The relay is alive, in ``state``, on the row it registered at ``started_at``. False if
    that row is gone or was taken over (this relay looked dead)."""
    stmt = (
        sa.update(relays)
        .where(_held(relay_id, host, pid, started_at))
        .values(heartbeat_at=now, state=state)
    )
    return conn.execute(stmt).rowcount == 1


def stop_held(
    conn: sa.Connection, *, relay_id: str, host: str, pid: int, started_at: datetime, now: datetime
) -> None:
    """The relay exited cleanly (its own row only: never a successor's)."""
    conn.execute(
        sa.update(relays)
        .where(_held(relay_id, host, pid, started_at))
        .values(heartbeat_at=now, state=RelayState.STOPPED.value)
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
