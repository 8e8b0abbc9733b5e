"""The producer: the loop's one-transaction pass, and the claims waiting to start."""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from outbox.message import Email
from relay import signals, store, tracing
from relay.config import RelayConfig
from relay.db import is_outage
from relay.limits import Limits
from relay.loop.admission import BudgetFilter, Deferred, PauseFilter, SuppressionFilter, Wave
from relay.loop.announce import announce_expired, announce_saved
from relay.loop.completer import Completer
from relay.loop.connection import LoopConnection
from relay.loop.dispatch import Dispatch
from relay.loop.pausing import PauseControl, scopes
from relay.loop.records import Done, Ready, by_token, fitted
from relay.pause import ACCOUNT, Pauses, Scope
from relay.policy import Action, Decision
from relay.ratelimit import SendBudget

__all__ = ["Producer"]

_log = logging.getLogger("relay")


class Producer:
    """Claims what can be sent now and hands the wave the filters admit to dispatch."""

    def __init__(
        self,
        *,
        source: Any,
        config: RelayConfig,
        clock: Callable[[], datetime],
        connection: LoopConnection,
        completer: Completer,
        dispatch: Dispatch,
        pauses: Pauses,
        control: PauseControl,
        limiter: SendBudget,
        stopping: threading.Event,
    ) -> None:
        self._source = source  # the relay: the sender of every signal
        self.config = config
        self._clock = clock
        self._connection = connection
        self._completer = completer
        self._dispatch = dispatch
        self.pauses = pauses
        self._control = control
        self.limiter = limiter
        self._stopping = stopping
        self.held = PauseFilter(pauses)
        self.relay_id = config.relay_id
        self.budget = BudgetFilter(limiter, config.relay_id, clock, Limits(config.limits))
        self.suppressions = SuppressionFilter(pauses)
        self.filters = (self.held, self.budget, self.suppressions)
        self.ready: list[Ready] = []  # claimed, not yet started
        self.probe_found_nothing = False  # an account probe's claim found no due message
        self.deferred_until: datetime | None = None  # the latest a limit sent a claim back to
        self.held_keys: dict[str, datetime] = {}  # keys at their limit -> claim them from then
        self.claimed_at: datetime | None = None  # the time of the last claim that committed

    def claim_limit(self) -> tuple[int, bool]:
        """How many rows to claim now, and whether the claim is a paused relay's probe."""
        if self._stopping.is_set():
            return 0, False
        sending = self._dispatch.sending()
        free = self.config.concurrency - sending - len(self.ready)
        limit = min(free, self.config.batch_size, int(min(self.limiter.available(), 1e9)))
        if not self.pauses.account_paused:
            return max(0, limit), False
        if not self.pauses.probe_due(ACCOUNT) or sending or self.ready:
            return 0, False
        return min(limit, 1), limit > 0

    def exchange(self, now: datetime) -> bool:
        """Save finished sends, claim what can be sent now, mark the wave the filters admit:
        one transaction, committed before any of the wave is handed to a thread.

        If it fails, nothing is forgotten: finished sends stay unsaved, and the rows it
        claimed join the unstarted ones, to be marked under their claim token next time (if
        the claim did not commit, that mark finds no row and nothing is sent)."""
        limit, probe = self.claim_limit()
        completer = self._completer
        if not (completer.unsaved or limit > 0 or self.budget.admissible(self.ready)):
            return False
        due_before = self._control.due_to_end()
        batch = list(completer.unsaved)
        claims: list[store.Claim] = []
        expired: list[store.Expired] = []
        wave: Wave = []
        deferred: Deferred = []
        # (id, claim token) -> the send's start (send_started_at): an id may be ready twice
        marked: dict[tuple[int, str], datetime] = {}
        pending = list(self.ready)  # the unstarted claims, with this pass's new ones
        invalid: list[Done] = []  # claims whose payload is not an email
        taken: set[int] = set()  # ids of the ready admitted or sent back by this pass
        barred: list[Done] = []
        barred_applied: list[bool] = []
        began = time.monotonic()
        try:
            with self._connection.transaction() as conn:
                taking: store.Taking | None = None
                held: list[tuple[store.Claim, float]] = []
                lock = functools.partial(
                    store.save_and_lock,
                    conn,
                    relay_id=self.relay_id,
                    limit=limit,
                    now=now,
                    lease_seconds=self.config.lease_seconds,
                    skip_keys=self._held_keys(now) if limit > 0 else (),
                )
                if limit > 0 and batch:
                    # the last wave's sent saves, then the claim's read: one statement on
                    # PostgreSQL, where a busy pass is this and the claim's write
                    took_lock: list[tuple[store.Taking, float]] = []

                    def finish(sent: store.SentSave) -> set[tuple[int, str]]:
                        at = time.monotonic()  # the claim's time, from its read
                        moved, locked = lock(sent)
                        took_lock.append((locked, at))
                        return moved

                    applied = completer.save(conn, batch, now, finish=finish)
                    taking, began = took_lock[0]
                else:
                    applied = completer.save(conn, batch, now)
                    if limit > 0:
                        began = time.monotonic()
                        taking = lock(store.SentSave((), (), now))[1]
                if taking is not None:
                    # read and locked; on PostgreSQL written below, with the marks of those
                    # sent at once: a message sent at once is written once, not twice
                    claims, expired = taking.claims, taking.expired
                    held = self._accept(claims, now, pending, invalid)
                    if due_before and len(claims) + len(expired) < limit:
                        due_before = self._control.unheld(conn, due_before, now)
                wave, deferred = self.budget.admit(conn, pending)
                self._hold_keys(self.budget.retry)
                admitted = len(wave)
                taken = {id(r) for r, _ in wave} | {id(r) for r, _ in deferred}
                if taking is not None:
                    # the claim written (every row it read), before anything in its name, in
                    # the statement that screens the wave: a barred message is not marked
                    fresh = [r.claim.id for r, _ in wave if r.claim.claim_token == taking.token]
                    took = store.take_batch(
                        conn, taking, mark=fresh, now=now, screen=self.suppressions.wanted(wave)
                    )
                    marked.update(((id_, taking.token), took.at) for id_ in took.stamped)
                    wave, barred = self.suppressions.apply(wave, took.suppressed, now)
                else:
                    wave, barred = self.suppressions.screen(conn, wave, now)
                self.budget.prune(conn)
                self._step_back(conn, held, now)
                self._defer(conn, deferred, now)
                barred_applied = completer.save(conn, barred, now)
                for token, ids in by_token(r.claim for r, _ in wave).items():
                    ids = [i for i in ids if (i, token) not in marked]
                    stamped, at = store.mark_send_started_at(
                        conn, ids=ids, claim_token=token, now=now
                    )
                    marked.update(((id_, token), at) for id_ in stamped)
        except sa.exc.DBAPIError as exc:
            if is_outage(exc):
                # The commit may have applied unseen: what was claimed stays queued, to be
                # marked under its claim token next time (a claim that did not commit finds
                # no row then, and nothing is sent).
                self.ready = pending
                completer.unsaved.extend(invalid)
                raise
            # A statement's own error: the transaction rolled back, claims included.
            if not batch:
                raise
            # One finished send cannot be saved (its row deleted or changed under it): save
            # each alone, so that one never holds back the others or the next claims.
            completer.save_alone(batch, now)
            return True
        finally:
            if limit > 0:
                signals.claim_completed.send(
                    self._source,
                    duration=time.monotonic() - began,
                    count=len(claims),
                    expired=len(expired),
                )
        if limit > 0:
            self.claimed_at = now
        del completer.unsaved[: len(batch)]
        completer.unsaved.extend(invalid)
        # only once the marks committed: what was admitted or sent back leaves the queue
        self.ready = [r for r in pending if id(r) not in taken]
        announce_saved(self._source, batch, applied)
        announce_saved(self._source, barred, barred_applied)
        announce_expired(self._source, expired)
        if claims:
            _log.debug("claimed", extra={"action": "claimed", "count": len(claims)})
        if probe:
            self.probe_found_nothing = not (claims or self.ready or wave)
            if self.probe_found_nothing:
                self.pauses.probe_lost(ACCOUNT)  # nothing to probe with: look again later
        elif due_before and limit > 0 and len(claims) + len(expired) < limit:
            self._control.retire_unprobed(due_before)
        for ready in self._dispatch.start(wave, marked, now):
            if ready.probe is not None:  # the probe is gone: probe again after a pause
                self.pauses.probe_lost(ready.probe)
        return bool(batch or claims or expired or admitted)

    def _accept(
        self, claims: list[store.Claim], now: datetime, pending: list[Ready], invalid: list[Done]
    ) -> list[tuple[store.Claim, float]]:
        """Queue new claims to be sent (onto ``pending``); a payload that is not an email
        fails unsent (onto ``invalid``); returns those of a paused scope, with how long each
        waits (:meth:`_step_back` sends them back, once the claim is written)."""
        held: list[tuple[store.Claim, float]] = []
        for claim in claims:
            signals.claimed.send(self._source, message_id=claim.id, category=claim.category)
            try:
                payload = claim.payload
                if isinstance(payload, str):
                    payload = json.loads(payload)
                email = Email.from_payload(payload)
            except Exception as exc:  # not JSON, too deep or too large for Python, not an email
                decision = fitted(
                    Decision(action=Action.FAIL, code="invalid_payload", message=str(exc))
                )
                invalid.append(
                    Done(
                        claim=claim,
                        started_at=None,
                        finished_at=now,
                        outcome=None,
                        decision=decision,
                    )
                )
                continue
            trace = tracing.stored(payload)
            go, probe, wait = self.held.admit(email)
            if go:
                pending.append(Ready(claim=claim, email=email, probe=probe, trace=trace))
            else:
                held.append((claim, wait))
        return held

    def _step_back(
        self, conn: sa.Connection, held: list[tuple[store.Claim, float]], now: datetime
    ) -> None:
        """A paused scope's new claims step back in line until its next probe."""
        for claim, wait in held:
            later = now + timedelta(seconds=wait)
            store.release_unsent(
                conn, ids=[claim.id], claim_token=claim.claim_token, now=now, next_attempt_at=later
            )
            _log.info(
                "held: its sending is paused", extra={"action": "held", "message_id": claim.id}
            )

    def _hold_keys(self, retry: dict[str, datetime]) -> None:
        """Leave a key at its limit out of the claim until its scope may have room: claiming
        its due rows before then would only send them back, in place of other keys' mail."""
        for scope, at in retry.items():
            if scope.startswith("key:"):
                key = scope.removeprefix("key:")
                self.held_keys[key] = min(self.held_keys.get(key, at), at)

    def _held_keys(self, now: datetime) -> list[str]:
        """The keys whose due rows the claim leaves alone now (their limit holds them)."""
        self.held_keys = {k: t for k, t in self.held_keys.items() if t > now}
        return sorted(self.held_keys)

    def _defer(self, conn: sa.Connection, deferred: Deferred, now: datetime) -> None:
        """Send back in line, no attempt used, the claims their own key or identity holds back
        (its rate, its sends in flight), each until that scope has room."""
        if not deferred:
            return
        groups: dict[tuple[str, datetime], list[int]] = {}
        for ready, until in deferred:
            groups.setdefault((ready.claim.claim_token, until), []).append(ready.claim.id)
            if ready.probe is not None:  # nothing was sent: the scope is still unprobed
                self.pauses.probe_lost(ready.probe)
            self.deferred_until = max(self.deferred_until or until, until)
        for (token, until), ids in groups.items():
            store.release_unsent(conn, ids=ids, claim_token=token, now=now, next_attempt_at=until)
        _log.info(
            "%d claimed messages over their key's or identity's limit step back in line",
            len(deferred),
            extra={"action": "limited", "count": len(deferred)},
        )

    def release(self, scope: Scope | None = None) -> None:
        """Give back the claims waiting to start: all of them (drain, an account pause), or
        those of one paused scope, which step back in line until its next probe."""
        if scope is None:
            chosen, later = self.ready, None
        else:
            chosen = [r for r in self.ready if scope.holds(scopes(r.email))]
            later = self._clock() + timedelta(seconds=self.config.pause_seconds)
        if not chosen:
            return
        now = self._clock()
        with self._connection.transaction() as conn:
            for token, ids in by_token(r.claim for r in chosen).items():
                back = store.release_unsent(
                    conn, ids=ids, claim_token=token, now=now, next_attempt_at=later
                )
                if back < len(ids):  # swept and taken by another relay meanwhile
                    _log.warning(
                        "%d of %d claims were no longer held when given back",
                        len(ids) - back,
                        len(ids),
                        extra={"action": "lease_lost"},
                    )
        for ready in chosen:
            claim = ready.claim
            _log.info("released unstarted", extra={"action": "released", "message_id": claim.id})
            signals.released.send(self._source, message_id=claim.id, category=claim.category)
            if ready.probe is not None:
                self.pauses.probe_lost(ready.probe)
        gone = {id(r) for r in chosen}
        self.ready = [r for r in self.ready if id(r) not in gone]
