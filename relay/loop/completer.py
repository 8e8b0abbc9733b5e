"""The completer: finished sends decided and saved; one that cannot be saved saved alone."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from relay import signals, store, tracing
from relay.config import RelayConfig
from relay.db import is_outage
from relay.loop.announce import announce_saved
from relay.loop.connection import LoopConnection
from relay.loop.records import Done, InFlight, attempt_record, done_outcome, fitted
from relay.pause import ACCOUNT, Scope
from relay.policy import Action, decide
from relay.senders import Disabled, Outcome

__all__ = ["Completer"]

_log = logging.getLogger("relay")


class Completer:
    """Finished sends between their end and their save: ``unsaved`` (saved by the next pass)
    and ``stuck`` (could not be saved; kept, their leases renewed, retried)."""

    def __init__(
        self,
        source: Any,
        config: RelayConfig,
        connection: LoopConnection,
        rng: random.Random,
        *,
        stuck_retry: Callable[[], float],
    ) -> None:
        self._source = source  # the relay: the sender of every signal
        self.config = config
        self._connection = connection
        self._rng = rng
        self.unsaved: list[Done] = []
        self.stuck: list[Done] = []
        self.relay_id = config.relay_id
        self.set_aside = 0  # finished sends that could not be saved as they were
        self._stuck_retry = stuck_retry  # seconds between tries to save a stuck one, read each time
        self._last_stuck_retry = 0.0

    def collect(
        self,
        finished: Iterable[tuple[InFlight, Outcome, float]],
        now: datetime,
        react: Callable[[Outcome, Scope | None], None],
    ) -> None:
        """Decide each finished send and queue it to be saved; ``react`` hears each outcome
        before anything more is claimed (a pause, a throttle)."""
        for flight, outcome, duration in finished:
            decision = fitted(decide(outcome, flight.claim.state, now, self._rng))
            if isinstance(outcome, Disabled) and outcome.pause and outcome.scope != ACCOUNT:
                # only this scope is paused: its message steps back in line until its probe
                later = now + timedelta(seconds=self.config.pause_seconds)
                decision = dataclasses.replace(decision, next_attempt_at=later)
            self.unsaved.append(
                Done(
                    claim=flight.claim,
                    started_at=flight.started_at,
                    finished_at=now,
                    outcome=outcome,
                    decision=decision,
                    duration=duration,
                    dropped=flight.dropped,
                    trace=flight.trace,
                )
            )
            react(outcome, flight.probe)

    @tracing.settles
    def save(
        self,
        conn: sa.Connection,
        batch: list[Done],
        now: datetime,
        *,
        attempts: bool = True,
        finish: Callable[[store.SentSave], set[tuple[int, str]]] | None = None,
    ) -> list[bool]:
        """Write each decision (guarded by its claim) and its attempt row; returns, per
        item, whether the decision applied. The sent ones and every attempt row are written
        last, by ``finish`` when given (the pass's claim read runs them in its statement:
        ``store.save_and_lock``), which returns the (id, claim token) pairs moved to sent."""
        if not batch:
            return []
        # the other decisions first, each under its guard: which of them applied decides
        # their attempt rows, and a sent one's is settled by the statement that moves it
        others = {
            k: store.apply_decision(conn, done.claim, done.decision, now)
            for k, done in enumerate(batch)
            if done.decision.action is not Action.SENT
        }
        items = [
            (d.claim.id, d.claim.claim_token, d.decision.provider_message_id)
            for d in batch
            if d.decision.action is Action.SENT
        ]
        records = [
            # a sent decision is always a call's (nothing ``recorded``): its row is written
            # whether its claim held or not, ``stale:`` if not
            (attempt_record(done, self.relay_id, stale=False), True)
            if k not in others
            else (attempt_record(done, self.relay_id, stale=not others[k]), False)
            for k, done in enumerate(batch)
            # a suppressed message whose claim was gone: nothing was sent, nothing moved
            if k not in others or others[k] or done.recorded is None
        ]
        save = store.SentSave(items, records if attempts else [], now)
        sent = store.save_sent(conn, save) if finish is None else finish(save)
        return [
            others.get(k, (done.claim.id, done.claim.claim_token) in sent)
            for k, done in enumerate(batch)
        ]

    def finalize(self, now: datetime) -> bool:
        """Save the finished sends now, in a transaction of their own (drain, tests)."""
        if not self.unsaved:
            return False
        batch = list(self.unsaved)
        try:
            with self._connection.transaction() as conn:
                applied = self.save(conn, batch, now)
        except sa.exc.DBAPIError as exc:
            if is_outage(exc):
                raise
            self.save_alone(batch, now)  # one that cannot be saved never holds back the rest
            return True
        del self.unsaved[: len(batch)]
        announce_saved(self._source, batch, applied)
        return True

    def save_alone(self, batch: list[Done], now: datetime) -> None:
        """Save each of ``batch`` in its own transaction. One that fails is saved again
        without its attempt row (logged in full instead); one whose transition itself fails
        is set aside: kept, its lease renewed (the sweep must never turn a known outcome into
        an ambiguous one), retried every ``stuck_retry()`` seconds (``save_failed``)."""
        for done in batch:
            try:
                try:
                    with self._connection.transaction() as conn:
                        applied = self.save(conn, [done], now)
                except sa.exc.DBAPIError as exc:
                    if is_outage(exc):
                        raise
                    self._log_unsaved(done, exc, "its attempt row cannot be written")
                    with self._connection.transaction() as conn:
                        applied = self.save(conn, [done], now, attempts=False)
                    self._set_aside(done)
            except sa.exc.DBAPIError as exc:
                if is_outage(exc):
                    raise  # the rest stay where they are, for the next pass
                first = done not in self.stuck
                self._remove(done)
                self.stuck.append(done)
                if first:
                    self._log_unsaved(done, exc, "it cannot be saved; set aside, retried")
                    self._set_aside(done)
                continue
            self._remove(done)
            announce_saved(self._source, [done], applied)

    def retry_stuck(self, now: datetime) -> None:
        if self.stuck and time.monotonic() - self._last_stuck_retry >= self._stuck_retry():
            self._last_stuck_retry = time.monotonic()
            self.save_alone(list(self.stuck), now)

    def _set_aside(self, done: Done) -> None:
        self.set_aside += 1
        signals.save_failed.send(
            self._source,
            message_id=done.claim.id,
            category=done.claim.category,
            code=done.decision.code,
            provider_message_id=done.decision.provider_message_id,
            outcome=done_outcome(done),
        )

    def _remove(self, done: Done) -> None:
        for pending in (self.unsaved, self.stuck):
            if done in pending:
                pending.remove(done)

    def _log_unsaved(self, done: Done, exc: sa.exc.DBAPIError, what: str) -> None:
        _log.error(
            "a finished send: %s: %s",
            what,
            exc.orig if exc.orig is not None else exc,
            extra={
                "action": "save_failed",
                "message_id": done.claim.id,
                "outcome": done_outcome(done),
                "decision": done.decision.action.value,
                "code": done.decision.code,
                "provider_message_id": done.decision.provider_message_id,
            },
        )
