"""The registry: this relay's row in ``outbox_relays`` (register, heartbeat, deregister)."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TypeVar

import sqlalchemy as sa

from outbox.exceptions import ConfigurationError
from outbox.schema import RelayState
from relay import store
from relay.config import RelayConfig
from relay.db import READ_COMMITTED, autocommits, masked_url
from relay.loop.connection import LoopConnection
from relay.pause import ACCOUNT, Pauses
from relay.senders import Sender

__all__ = ["Registry"]

_T = TypeVar("_T")

_log = logging.getLogger("relay")

# seconds: a change of the paused scopes is written with the next heartbeat after at least
# this long since the last one, not a whole interval later (a storm of pauses beginning and
# ending costs at most one row update a second)
_CHANGE_BEAT = 1.0


class Registry:
    """One relay id, one live relay: the row this relay holds, kept alive by heartbeats."""

    def __init__(
        self,
        config: RelayConfig,
        connection: LoopConnection,
        clock: Callable[[], datetime],
        pauses: Pauses,
    ) -> None:
        self.config = config
        self._connection = connection
        self._clock = clock
        self.pauses = pauses  # the relay's: its scoped ones are written with each heartbeat
        self._shown = pauses.changes  # pauses.changes when the row last showed the pauses
        self.with_pauses = True  # False once the role or the schema refused paused_scopes
        self.relay_id = config.relay_id
        self.registered_at: datetime | None = None  # started_at of the row this relay holds
        # started_at of each register whose commit this relay did not see (a lost or timed-out
        # COMMIT may have applied): a row carrying one is its own, not another relay's
        self._unseen: list[datetime] = []
        self._last_heartbeat = 0.0

    def check_schema(self) -> None:
        """Refuse an engine in AUTOCOMMIT, and a database without every outbox table (never
        migrated, or migrated by an older release)."""
        with self._connection.transaction() as conn:
            missing = store.missing_tables(conn)
            unlocked = autocommits(conn)
        if unlocked:
            self._connection.drop()  # run() ends here, before its own cleanup
            raise ConfigurationError(
                "engine",
                "the relay's engine runs in AUTOCOMMIT, so a claim's row locks would end with "
                "each statement and two relays could take one message; give the relay an "
                "engine of its own without isolation_level='AUTOCOMMIT'",
            )
        if missing:
            raise ConfigurationError(
                "--database-url",
                f"the database lacks the outbox tables {', '.join(missing)}; "
                "run `outbox-relay migrate --database-url ...` with the same URL first",
            )

    def register(self, sender: Sender, engine: sa.Engine, state: RelayState) -> None:
        """Take this relay's row. Raises ConfigurationError if a live relay (one that
        heartbeated within three heartbeat intervals, by the database's clock) holds the id."""
        try:
            holder = self._take_row(state)
        except sa.exc.IntegrityError:  # a relay with this id inserted its row just now
            holder = self._take_row(state)
        if holder is not None:
            age = (self._clock() - holder.heartbeat_at).total_seconds()
            self._connection.drop()  # run() ends here, before its own cleanup
            raise ConfigurationError(
                "--relay-id",
                f"{self.relay_id!r} is in use by a running relay on host {holder.host} "
                f"(pid {holder.pid}, {holder.state}, last heartbeat {age:.1f}s ago); give "
                "each relay its own id (or leave --relay-id unset)",
            )
        self._last_heartbeat = time.monotonic()
        _announce_start(self.relay_id, sender, engine)

    def beat_soon(self) -> None:
        """Heartbeat on the next pass (a state change shows in ``outbox_relays`` at once)."""
        self._last_heartbeat = 0.0

    def heartbeat(self, now: datetime, state: RelayState) -> store.RelayHolder | None:
        """Show this relay alive on its row, with its scoped pauses, registering again if the
        row is gone; returns the relay that took the id over (this one looked dead for three
        heartbeat intervals: frozen, or cut off from the database), which means stop: one id,
        one relay. Due every heartbeat interval, or a second after the last beat once the set
        of paused scopes changed."""
        since = time.monotonic() - self._last_heartbeat
        changed = self.pauses.changes != self._shown and since >= _CHANGE_BEAT
        if since < self.config.heartbeat_interval and not changed:
            return None
        shown = self.pauses.changes

        def beat(conn: sa.Connection) -> tuple[bool, store.RelayHolder | None]:
            mine = self._holds_row(conn, now, state)
            return mine, None if mine else self._register_row(conn, now)

        mine, holder = self._transaction(beat)
        self._last_heartbeat = time.monotonic()
        if mine:
            self._shown = shown
            return None
        if holder is None:
            self.registered_at = now
            self._unseen.clear()
            return None
        self.registered_at = None
        return holder

    def _transaction(self, work: Callable[[sa.Connection], _T]) -> _T:
        """``work`` in one transaction on the loop's connection; if it failed for want of
        ``paused_scopes`` (the role's grant, or a schema not migrated yet), once more without
        it, and without it from then on: the pauses are for showing, the heartbeat is what
        keeps the relay's id. Said once, with what to do."""
        try:
            with self._connection.transaction() as conn:
                return work(conn)
        except sa.exc.DBAPIError as exc:
            if not (self.with_pauses and store.pauses_refused(exc)):
                raise
            self.with_pauses = False
            _log.warning(
                "outbox_relays.paused_scopes cannot be written (%s): the relay beats without "
                "showing its scoped pauses; run outbox-relay migrate and grant the relay's "
                "role UPDATE on it (examples/deploy/grants-*.sql; outbox-relay doctor checks)",
                exc.orig if exc.orig is not None else exc,
                extra={"action": "pauses_not_shown"},
            )
        with self._connection.transaction() as conn:
            return work(conn)

    def deregister(self) -> None:
        if self.registered_at is not None:
            registered_at = self.registered_at

            def stop(conn: sa.Connection) -> None:
                store.stop_held(
                    conn,
                    relay_id=self.relay_id,
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    started_at=registered_at,
                    now=self._clock(),
                    with_pauses=self.with_pauses,
                )

            self._transaction(stop)
        _log.info("relay stopped", extra={"action": "stopped", "relay_id": self.relay_id})

    def _holds_row(self, conn: sa.Connection, now: datetime, state: RelayState) -> bool:
        """Heartbeat the row this relay registered; False if it has none, or lost it."""
        return self.registered_at is not None and store.heartbeat_held(
            conn,
            relay_id=self.relay_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.registered_at,
            now=now,
            state=state,
            pauses=self._pauses_text(now) if self.with_pauses else None,
            with_pauses=self.with_pauses,
        )

    def _pauses_text(self, now: datetime) -> str | None:
        """The relay's scoped pauses as its row shows them (the account's is its state),
        their times on the database's clock (``now``)."""
        return store.pauses_text(
            store.PausedScope(
                kind=p.scope.kind.value,
                name=p.scope.name,
                via=p.scope.via,
                code=p.code,
                since=now - timedelta(seconds=p.age),
                until=None if p.probe_in is None else now + timedelta(seconds=p.probe_in),
            )
            for p in self.pauses.snapshot()
            if p.scope != ACCOUNT
        )

    def _take_row(self, state: RelayState) -> store.RelayHolder | None:
        """Register; returns the live holder of the relay id instead, if there is one."""
        now = self._clock()

        def take(conn: sa.Connection) -> tuple[bool, store.RelayHolder | None]:
            if self._holds_row(conn, now, state):
                return True, None  # registered already (a heartbeat before run() did it)
            return False, self._register_row(conn, now)

        held, holder = self._transaction(take)
        if held:
            return None
        if holder is not None:
            return holder
        with self._connection.transaction() as conn:
            if conn.dialect.name in ("mysql", "mariadb"):
                level = conn.get_isolation_level()
                if level != READ_COMMITTED:
                    _log.warning(
                        "engine runs at %s: concurrent claims will wait on gap locks; "
                        "build it with relay.db.make_engine (READ COMMITTED)",
                        level,
                        extra={"action": "isolation_level"},
                    )
        self.registered_at = now
        self._unseen.clear()
        return None

    def _register_row(self, conn: sa.Connection, now: datetime) -> store.RelayHolder | None:
        """``store.register`` in the caller's transaction; ``now`` is remembered as unseen
        until the caller saw that transaction commit."""
        holder = store.register(
            conn,
            relay_id=self.relay_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            now=now,
            dead_after=3 * self.config.heartbeat_interval,
            unseen=tuple(self._unseen),
            with_pauses=self.with_pauses,
        )
        if holder is None:
            self._unseen = [*self._unseen[-15:], now]
            # the row was written without pauses: if this relay has some, the next beat shows them
            self._shown = -1 if self.pauses else self.pauses.changes
        return holder


def _announce_start(relay_id: str, sender: Sender, engine: sa.Engine) -> None:
    """One line naming what this relay does: its sender and where it sends, its id and its
    database (the password masked); a warning if the sender delivers nothing."""
    where = getattr(sender, "where", None)
    details = where() if callable(where) else {}
    _log.info(
        "relay started",
        extra={
            "action": "started",
            "relay_id": relay_id,
            "sender_kind": sender.name,
            **details,
            "database": masked_url(engine.url),
        },
    )
    if getattr(sender, "delivers", True) is False:  # console, file: BaseSender.delivers
        _log.warning(
            "the %s sender delivers nothing: each message is marked sent but none leaves "
            "this machine; use --sender ses or smtp to deliver",
            sender.name,
            extra={"action": f"{sender.name}_sender"},
        )
