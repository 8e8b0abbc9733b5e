"""The relay loop: save finished sends, claim and mark what can be sent now, send on threads.

The loop is thin on purpose. Decisions come from :mod:`relay.policy`, SQL from
:mod:`relay.store`, pauses from :mod:`relay.pause`, shared time from :mod:`relay.clock`; this
module only orders them, and never holds a database transaction while a send is in flight. A
busy pass costs one transaction (finished sends saved, the next batch claimed and its wave
marked) on a connection the loop keeps; sweeps run once a second, always after the pass has
saved what finished, so a relay never sweeps its own finished sends.

Time: everything compared across relays (leases, the sweep's cut-off, heartbeats) is on the
database's clock; intervals inside the process (the send deadline, sweep and heartbeat
intervals, pauses) are on the monotonic clock. A relay host's wall clock is never used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
import tenacity
from blinker import NamedSignal
from sqlalchemy.pool import SingletonThreadPool, StaticPool

from outbox.exceptions import ConfigurationError
from outbox.message import Email
from outbox.schema import AttemptOutcome, RelayState
from relay import signals, store, tracing
from relay.clock import DatabaseClock
from relay.config import RelayConfig, valid_send_rate
from relay.db import READ_COMMITTED, is_outage, masked_url, retry_delay
from relay.pause import ACCOUNT, Admission, Pauses, Scope, ScopeKind, identity
from relay.policy import Action, Decision, decide
from relay.ratelimit import RateController, SendBudget, Slot
from relay.recipients import address_key
from relay.senders import (
    Accepted,
    Ambiguous,
    Disabled,
    Outcome,
    OutgoingMessage,
    Permanent,
    Sender,
    Transient,
    as_sender,
)

__all__ = ["STUCK_RETRY", "Relay"]

_log = logging.getLogger("relay")

_EXPIRE_INTERVAL = 30.0  # seconds between scans for rows past expires_at that are not yet due
_SWEEP_INTERVAL = 1.0  # seconds between sweeps for expired leases
# seconds between reconcile passes (run by the sweep); a reconcile window is minutes
_RECONCILE_INTERVAL = 5.0
_AUTO_RATE_FALLBACK = 1.0  # recipients/s when --max-send-rate auto cannot read the account
_SENDER_ERRORS_TO_PAUSE = 3  # consecutive sends the sender raised on: pause, do not burn the queue
STUCK_RETRY = 30.0  # seconds between tries to save a finished send that could not be saved
# what the relay writes must fit its columns, or a provider's long answer would make a
# finished send unsaveable
_CODE_CHARS, _ID_CHARS, _TEXT_CHARS = 100, 255, 4000

_OUTCOME_NAMES: dict[type, AttemptOutcome] = {
    Accepted: AttemptOutcome.ACCEPTED,
    Transient: AttemptOutcome.TRANSIENT,
    Permanent: AttemptOutcome.PERMANENT,
    Ambiguous: AttemptOutcome.AMBIGUOUS,
    Disabled: AttemptOutcome.DISABLED,
}
_SIGNALS: dict[Action, NamedSignal] = {
    Action.SENT: signals.sent,
    Action.RETRY: signals.retry_scheduled,
    Action.FAIL: signals.failed,
    Action.HOLD: signals.unknown_outcome,
    Action.RELEASE: signals.released,
}
_LOG_ACTIONS = {
    Action.SENT: "sent",
    Action.RETRY: "retry_scheduled",
    Action.FAIL: "failed",
    Action.HOLD: "unknown_outcome",
    Action.RELEASE: "released",
}


@dataclass(kw_only=True, slots=True)
class _InFlight:
    claim: store.Claim
    started_at: datetime
    future: Future[tuple[Outcome, float]]  # the outcome, and the provider call's seconds
    deadline: float  # monotonic: past it the lease is no longer renewed (--send-timeout)
    probe: Scope | None = None  # the paused scope this send probes
    overdue: bool = False  # past its deadline, logged once
    dropped: tuple[str, ...] = ()  # suppressed recipients left out of this send
    trace: tracing.Attempt | None = None  # the send's span (tracing on)


@dataclass(kw_only=True, slots=True)
class _Ready:
    """A claimed message whose send has not started."""

    claim: store.Claim
    email: Email
    probe: Scope | None = None
    dropped: tuple[str, ...] = ()  # suppressed recipients taken out of ``email``
    trace: tracing.Carrier | None = None  # the enqueue's stored trace context (tracing on)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Done:
    claim: store.Claim
    started_at: datetime | None
    finished_at: datetime
    outcome: Outcome | None  # None: the payload could not be turned into an email
    decision: Decision
    duration: float | None = None  # seconds the provider call took; None: no call
    recorded: AttemptOutcome | None = None  # the attempt's outcome when no call was made
    dropped: tuple[str, ...] = ()  # suppressed recipients not sent to
    trace: tracing.Attempt | None = None  # the attempt's span, linked from its save's


def _scopes(email: Email) -> tuple[Scope, ...]:
    """The pausable scopes a message belongs to: the account, its configuration set (empty:
    the sender's default), its From address, its domain and the domains above it (a verified
    domain identity covers its subdomains: SES may name ``example.com`` for
    ``a@mail.example.com``)."""
    address = identity(email.sender)
    labels = address.rpartition("@")[2].split(".")
    domains = [".".join(labels[i:]) for i in range(max(1, len(labels) - 1))]
    return (
        ACCOUNT,
        Scope(ScopeKind.CONFIGURATION_SET, email.configuration_set or ""),
        Scope(ScopeKind.IDENTITY, address),
        *(Scope(ScopeKind.IDENTITY, domain) for domain in domains),
    )


class _Stopped(Exception):
    """Raised out of the start-up wait's sleep when the relay is told to stop."""


class Relay:
    """One relay process's loop. ``run()`` returns when stopped (drained) or, with
    ``exit_when_idle``, when nothing is due and nothing is in flight."""

    def __init__(
        self,
        *,
        engine: sa.Engine,
        sender: Sender,
        config: RelayConfig,
        clock: Callable[[], datetime] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``clock`` replaces the database's clock (tests that move time by hand); ``rng``,
        the random source of every jitter (retry backoff, polling, reconnecting), a seeded one
        for a replayable run."""
        self.engine = engine
        self.sender = as_sender(sender)
        self.config = config
        self._db_clock = DatabaseClock() if clock is None else None
        self.clock: Callable[[], datetime] = clock if clock is not None else self._db_clock  # type: ignore[assignment]
        self.relay_id = config.relay_id
        self._rng = rng if rng is not None else random.Random()
        self.rate = RateController(self._total_rate())
        # the send budget all relays share; without --max-send-rate it is never touched
        self.limiter = SendBudget(self.rate, clock=lambda: self.clock())
        self._registered_at: datetime | None = None  # started_at of the row this relay holds
        # started_at of each register whose commit this relay did not see (a lost or timed-out
        # COMMIT may have applied): a row carrying one is its own, not another relay's
        self._unseen_registers: list[datetime] = []
        self._wake = threading.Event()
        self._stopping = threading.Event()
        # twice the concurrency: a call hung past --send-timeout keeps its thread, but not its
        # slot; once as many are hung as there are slots, the relay pauses (sender_hung)
        self._pool = ThreadPoolExecutor(2 * config.concurrency, thread_name_prefix="outbox-send")
        # keyed by (id, claim token): a swept and reclaimed row can be in flight twice
        self._in_flight: dict[tuple[int, str], _InFlight] = {}
        self._ready: list[_Ready] = []  # claimed, not yet started
        self._unsaved: list[_Done] = []  # finished sends whose finalize has not committed yet
        self._stuck: list[_Done] = []  # finished sends that cannot be saved; kept, retried
        self._last_stuck_retry = 0.0
        self._probe_found_nothing = False  # an account probe's claim found no due message
        self._last_heartbeat = 0.0
        self.pauses = Pauses(config.pause_seconds)
        self._sender_errors = 0  # consecutive sends the sender raised on
        self._last_expire = 0.0
        self._last_sweep = -math.inf  # monotonic
        self._last_reconcile = -math.inf  # monotonic
        self._sweep_from = 0.0  # monotonic: no sweep before (after a database outage)
        self._conn: sa.Connection | None = None  # the loop's own, kept between passes
        self._db_failures = 0
        self.set_aside = 0  # finished sends that could not be saved (see _save_alone)
        self.state = RelayState.RUNNING
        self.loop_at: float | None = None  # monotonic time of the loop's last pass, in run()
        # monotonic time of the last try to reach the database before the loop's first pass
        self.waiting_at: float | None = None

    # -- control ---------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin draining: claim nothing more, finish what is in flight. Thread/signal-safe."""
        self._stopping.set()
        self._wake.set()

    def wake(self) -> None:
        """Look for due messages now (called on a PostgreSQL NOTIFY)."""
        self._wake.set()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def paused(self) -> bool:
        """True while all sending is paused (account paused, bad credentials, daily quota);
        a paused configuration set or identity holds only its own messages."""
        return self.pauses.account_paused

    @property
    def pause_code(self) -> str | None:
        """The provider's code while all sending is paused."""
        return self.pauses.code(ACCOUNT)

    def _total_rate(self) -> float | None:
        setting = self.config.max_send_rate
        if setting != "auto":
            return setting
        try:
            rate = self.sender.max_send_rate()
        except Exception as exc:  # a custom sender's bug must not stop the relay starting
            rate, why = None, f"an error reading the account rate ({type(exc).__name__}: {exc})"
        else:
            why = "no account rate" if rate is None else f"an unusable account rate {rate!r}"
        if not valid_send_rate(rate):  # None, or a value no limit can be built on
            _log.warning(
                "--max-send-rate auto: the sender reports %s; using %g/s",
                why,
                _AUTO_RATE_FALLBACK,
                extra={"action": "send_rate"},
            )
            return _AUTO_RATE_FALLBACK
        _log.info("account send rate %g/s", rate, extra={"action": "send_rate"})
        return float(rate)

    def run(self) -> None:
        """Run until stopped or, with ``exit_when_idle``, until there is nothing left to do.

        Raises :class:`~outbox.exceptions.ConfigurationError` before sending anything if the
        database has no outbox tables."""
        try:
            if not self._wait_for_the_database():
                return
        finally:  # once the loop runs, or never will (no outbox tables, the relay id in use)
            self.waiting_at = None
        try:
            while not self._stopping.is_set():
                self.loop_at = time.monotonic()
                busy = self._with_db(self.step)
                if busy is None:  # database error: back off, then try again
                    self._stopping.wait(self._db_backoff())
                    continue
                if not busy and self.config.exit_when_idle and self._idle():
                    _log.info("idle, exiting", extra={"action": "idle_exit"})
                    break
                if not busy:
                    self._wait()
            self._drain()
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._with_db(self._deregister)
            self._drop_connection()
            self.loop_at = None

    def _wait_for_the_database(self) -> bool:
        """Wait for the schema, then register; False if stopped before the database answered
        (nothing was claimed, nothing is registered). Each try is a sign of life for
        ``/healthz`` (``waiting_at``): a relay started during an outage must not be restarted
        by its liveness probe for it."""
        waiting = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda checked: checked is None),
            wait=lambda _: self._db_backoff(),
            sleep=self._sleep_unless_stopped,
            before=lambda _: setattr(self, "waiting_at", time.monotonic()),
        )
        try:
            waiting(self._with_db, self._check_schema)
        except _Stopped:
            self._pool.shutdown(wait=False)
            self._drop_connection()
            _log.info("stopped before the database answered", extra={"action": "stopped"})
            return False
        self._with_db(self._register)
        return True

    def _sleep_unless_stopped(self, seconds: float) -> None:
        """The start-up wait's sleep: a stop ends it at once, and no try follows it."""
        if self._stopping.wait(seconds):
            raise _Stopped

    # -- one tick --------------------------------------------------------------------------

    def step(self) -> bool:
        """One pass of the loop; True if it did any work (so the next pass follows at once).

        The order matters: finished sends are saved (and leases renewed) before any sweep, so
        after a database outage longer than the lease a relay settles its own sends instead
        of sweeping them as abandoned."""
        self._sync_clock()
        now = self.clock()
        self.rate.tick()
        self._collect(now)
        self._extend_leases(now)
        self._retry_stuck(now)
        busy = self._exchange(now)
        self._heartbeat(now)
        busy = self._sweep(now) or busy
        self._expire(now)
        return busy

    def _sync_clock(self) -> None:
        """Read the database's clock again when the last reading is old."""
        if self._db_clock is not None and self._db_clock.stale():
            with self._transaction() as conn:
                self._db_clock.sample(conn)

    def _check_schema(self) -> None:
        """Refuse a database without every outbox table (never migrated, or migrated by an
        older release)."""
        with self._transaction() as conn:
            missing = store.missing_tables(conn)
        if missing:
            raise ConfigurationError(
                "--database-url",
                f"the database lacks the outbox tables {', '.join(missing)}; "
                "run `outbox-relay migrate --database-url ...` with the same URL first",
            )

    def _exchange(self, now: datetime) -> bool:
        """Save finished sends, claim what can be sent now, mark the wave the rate limit
        admits: one transaction, committed before any of the wave is handed to a thread.

        If it fails, nothing is forgotten: finished sends stay unsaved, and the rows it
        claimed join the unstarted ones, to be marked under their claim token next time (if
        the claim did not commit, that mark finds no row and nothing is sent)."""
        limit, probe = self._claim_limit()
        if not (self._unsaved or limit > 0 or self._admissible()):
            return False
        # scoped pauses past their probe time that have held no message for longer than a
        # pause: whatever they held has been due again since, and was not claimed
        grace = max(1.0, 2 * self.config.poll_interval)
        due_before = [
            s
            for s in self.pauses.scopes
            if s != ACCOUNT
            and self.pauses.overdue(s) > grace
            and self.pauses.idle_for(s) > self.pauses.seconds + grace
        ]
        batch = list(self._unsaved)
        claims: list[store.Claim] = []
        expired: list[store.Expired] = []
        wave: list[tuple[_Ready, Slot | None]] = []
        # (id, claim token) -> the send's start (send_started_at): an id may be in _ready twice
        marked: dict[tuple[int, str], datetime] = {}
        ready_before = len(self._ready)
        admitted = 0
        barred: list[_Done] = []
        barred_applied: list[bool] = []
        began = time.monotonic()
        try:
            with self._transaction() as conn:
                applied = self._save(conn, batch, now)
                if limit > 0:
                    began = time.monotonic()
                    claims, expired = store.claim_batch(
                        conn,
                        relay_id=self.relay_id,
                        limit=limit,
                        now=now,
                        lease_seconds=self.config.lease_seconds,
                    )
                    self._accept(conn, claims, now)
                    if due_before and len(claims) + len(expired) < limit:
                        due_before = self._unheld(conn, due_before, now)
                wave = self._admit(conn)
                admitted = len(wave)
                wave, barred = self._screen(conn, wave, now)
                barred_applied = self._save(conn, barred, now)
                for token, ids in _by_token(r.claim for r, _ in wave).items():
                    stamped, at = store.mark_send_started_at(
                        conn, ids=ids, claim_token=token, now=now
                    )
                    marked.update(((id_, token), at) for id_ in stamped)
        except sa.exc.DBAPIError as exc:
            if is_outage(exc):
                # The commit may have applied unseen: what was claimed stays queued, to be
                # marked under its claim token next time (a claim that did not commit finds
                # no row then, and nothing is sent).
                raise
            # A statement's own error: the transaction rolled back, claims included.
            del self._ready[ready_before:]
            del self._unsaved[len(batch) :]
            if not batch:
                raise
            # One finished send cannot be saved (its row deleted or changed under it): save
            # each alone, so that one never holds back the others or the next claims.
            self._save_alone(batch, now)
            return True
        finally:
            if limit > 0:
                signals.claim_completed.send(
                    self,
                    duration=time.monotonic() - began,
                    count=len(claims),
                    expired=len(expired),
                )
        del self._unsaved[: len(batch)]
        del self._ready[:admitted]  # only once the marks committed
        self._announce_saved(batch, applied)
        self._announce_saved(barred, barred_applied)
        self._announce_expired(expired)
        if claims:
            _log.debug("claimed", extra={"action": "claimed", "count": len(claims)})
        if probe:
            self._probe_found_nothing = not (claims or self._ready or wave)
            if self._probe_found_nothing:
                self.pauses.probe_lost(ACCOUNT)  # nothing to probe with: look again later
        elif due_before and limit > 0 and len(claims) + len(expired) < limit:
            self._retire_unprobed(due_before)
        self._start(wave, marked, now)
        return bool(batch or claims or expired or admitted)

    def _unheld(self, conn: sa.Connection, due: list[Scope], now: datetime) -> list[Scope]:
        """Of the scoped pauses ``due`` to end (this relay's claim found none of their mail),
        those no other relay may be holding mail of: all of them while this relay runs
        alone; with others running (each holds what it claimed, and skips what another has
        locked), only those idle for ten pause periods, at least ten minutes, so that a pause
        nothing is left to probe still ends, and mail another relay held is tried at most once
        a while (a refusal pauses it again)."""
        since = now - timedelta(seconds=3 * self.config.heartbeat_interval)
        running, _ = store.live_heartbeats(conn, since=since)
        if running <= 1:
            return due
        patience = max(600.0, 10 * self.pauses.seconds)
        return [s for s in due if self.pauses.idle_for(s) > patience]

    def _retire_unprobed(self, due: list[Scope]) -> None:
        """End the scoped pauses that were due a probe before a claim that took every due
        message and found none of theirs (expired, cancelled, or a scope none of our mail
        belongs to): nothing is held by them, and a pause nothing can probe would never end.
        A later message of the scope that is still refused pauses it again."""
        for scope in due:
            if self.pauses.probe_due(scope):  # no message of it became the probe
                self.pauses.probe_ended(scope, paused=False)
                _log.warning(
                    "no message of %s is due: its pause ends",
                    scope,
                    extra={"action": "resumed", "scope": str(scope)},
                )

    def _save_alone(self, batch: list[_Done], now: datetime) -> None:
        """Save each finished send of ``batch`` in its own transaction, so one that cannot be
        saved never holds back the others or the next claims.

        One that fails is saved again without its attempt row (a row deleted under it ends
        here: its transition finds nothing, as for any stale claim), the attempt logged in
        full instead. One whose transition itself fails is set aside: kept, its lease renewed
        (the sweep must never turn a known outcome into an ambiguous one), retried every
        ``STUCK_RETRY`` seconds, reported as ``save_failed``."""
        for done in batch:
            try:
                try:
                    with self._transaction() as conn:
                        applied = self._save(conn, [done], now)
                except sa.exc.DBAPIError as exc:
                    if is_outage(exc):
                        raise
                    self._log_unsaved(done, exc, "its attempt row cannot be written")
                    with self._transaction() as conn:
                        applied = self._save(conn, [done], now, attempts=False)
                    self._set_aside(done)
            except sa.exc.DBAPIError as exc:
                if is_outage(exc):
                    raise  # the rest stay where they are, for the next pass
                first = done not in self._stuck
                self._remove(done)
                self._stuck.append(done)
                if first:
                    self._log_unsaved(done, exc, "it cannot be saved; set aside, retried")
                    self._set_aside(done)
                continue
            self._remove(done)
            self._announce_saved([done], applied)

    def _set_aside(self, done: _Done) -> None:
        """Count and announce a finished send whose result could not be saved as it was."""
        self.set_aside += 1
        signals.save_failed.send(
            self,
            message_id=done.claim.id,
            category=done.claim.category,
            code=done.decision.code,
            provider_message_id=done.decision.provider_message_id,
            outcome=_done_outcome(done),
        )

    def _remove(self, done: _Done) -> None:
        for pending in (self._unsaved, self._stuck):
            if done in pending:
                pending.remove(done)

    def _retry_stuck(self, now: datetime) -> None:
        if self._stuck and time.monotonic() - self._last_stuck_retry >= STUCK_RETRY:
            self._last_stuck_retry = time.monotonic()
            self._save_alone(list(self._stuck), now)

    def _log_unsaved(self, done: _Done, exc: sa.exc.DBAPIError, what: str) -> None:
        _log.error(
            "a finished send: %s: %s",
            what,
            exc.orig if exc.orig is not None else exc,
            extra={
                "action": "save_failed",
                "message_id": done.claim.id,
                "outcome": _done_outcome(done),
                "decision": done.decision.action.value,
                "code": done.decision.code,
                "provider_message_id": done.decision.provider_message_id,
            },
        )

    def _sending(self) -> int:
        """Sends in flight within their deadline (a hung call past it holds no slot)."""
        return sum(1 for flight in self._in_flight.values() if not flight.overdue)

    def _claim_limit(self) -> tuple[int, bool]:
        """How many rows to claim now, and whether the claim is a paused relay's probe."""
        if self._stopping.is_set():
            return 0, False
        sending = self._sending()
        free = self.config.concurrency - sending - len(self._ready)
        limit = min(free, self.config.batch_size, int(min(self.limiter.available(), 1e9)))
        if not self.pauses.account_paused:
            return max(0, limit), False
        if not self.pauses.probe_due(ACCOUNT) or sending or self._ready:
            return 0, False
        return min(limit, 1), limit > 0

    def _accept(self, conn: sa.Connection, claims: list[store.Claim], now: datetime) -> None:
        """Queue new claims to be sent; a payload that is not an email fails, unsent. While a
        scope is paused, its messages step back in line until its next probe (one of them is
        the probe)."""
        held: list[tuple[store.Claim, float]] = []
        for claim in claims:
            signals.claimed.send(self, message_id=claim.id, category=claim.category)
            try:
                payload = claim.payload
                if isinstance(payload, str):
                    payload = json.loads(payload)
                email = Email.from_payload(payload)
            except Exception as exc:  # not JSON, too deep or too large for Python, not an email
                decision = _fitted(
                    Decision(action=Action.FAIL, code="invalid_payload", message=str(exc))
                )
                self._unsaved.append(
                    _Done(
                        claim=claim,
                        started_at=None,
                        finished_at=now,
                        outcome=None,
                        decision=decision,
                    )
                )
                continue
            trace = tracing.stored(payload)
            if not self.pauses:
                self._ready.append(_Ready(claim=claim, email=email, trace=trace))
                continue
            admission, scope = self.pauses.admit(_scopes(email))
            if admission is Admission.HOLD:
                # at least a second: a scope whose probe is out would be claimed again at once
                held.append((claim, max(1.0, self.pauses.remaining(_scopes(email)))))
            else:
                self._ready.append(_Ready(claim=claim, email=email, probe=scope, trace=trace))
        for claim, wait in held:
            later = now + timedelta(seconds=wait)
            store.release_unsent(
                conn, ids=[claim.id], claim_token=claim.claim_token, now=now, next_attempt_at=later
            )
            _log.info(
                "held: its sending is paused",
                extra={"action": "held", "message_id": claim.id},
            )

    def _admissible(self) -> bool:
        return bool(self._ready) and self.limiter.available() >= 1

    def _admit(self, conn: sa.Connection) -> list[tuple[_Ready, Slot | None]]:
        """The unstarted claims the rate limit lets start, in order, each with the slot its
        send may start in (None: no limit, start at once).

        With a limit they are booked in the budget all relays share, in this transaction,
        under its lock: each at the earliest time that keeps every second within the limit,
        as far as the horizon reaches; the rest wait for a later pass."""
        if self.limiter.rate is None:
            return [(ready, None) for ready in self._ready]
        if not self._ready or self.limiter.available() < 1:
            return []
        store.lock_send_budget(conn)
        now, mono = self.clock(), time.monotonic()  # after the lock: it may have been waited for
        booked = store.send_bookings(conn, since=self.limiter.lookback(now))
        sizes = [max(1, ready.claim.recipient_count) for ready in self._ready]
        planned = self.limiter.plan(booked, sizes, now)
        store.book_sends(conn, relay_id=self.relay_id, bookings=planned)
        if (cutoff := self.limiter.prune_due(now)) is not None:
            store.prune_send_budget(conn, before=cutoff)
        return [
            (ready, Slot(planned=mono, start=mono + (booking.start - now).total_seconds()))
            for ready, booking in zip(self._ready, planned, strict=False)
        ]

    def _screen(
        self, conn: sa.Connection, wave: list[tuple[_Ready, Slot | None]], now: datetime
    ) -> tuple[list[tuple[_Ready, Slot | None]], list[_Done]]:
        """Take suppressed recipients out of the wave before its send-started mark: one
        lookup for the whole wave's To, Cc and Bcc (lower-cased addr-specs). A message left
        with no recipient fails (``suppressed``), never sent; one with some left goes to
        those, the dropped ones named in its attempt row. The stored payload is not changed:
        a later attempt screens against the suppressions of its own time."""
        if not wave:
            return wave, []
        suppressed = store.suppressed_among(
            conn, (address_key(a) for ready, _ in wave for a in ready.email.recipients)
        )
        if not suppressed:
            return wave, []
        kept: list[tuple[_Ready, Slot | None]] = []
        barred: list[_Done] = []
        for ready, slot in wave:
            email = ready.email
            dropped = tuple(
                dict.fromkeys(a for a in map(address_key, email.recipients) if a in suppressed)
            )
            if not dropped:
                kept.append((ready, slot))
                continue
            if all(address_key(a) in suppressed for a in email.recipients):
                decision = Decision(
                    action=Action.FAIL,
                    code="suppressed",
                    message="every recipient is suppressed: " + ", ".join(dropped),
                )
                barred.append(
                    _Done(
                        claim=ready.claim,
                        started_at=None,
                        finished_at=now,
                        outcome=None,
                        decision=_fitted(decision),
                        recorded=AttemptOutcome.SUPPRESSED,
                        dropped=dropped,
                    )
                )
                if ready.probe is not None:  # nothing was sent: the scope is still unprobed
                    self.pauses.probe_lost(ready.probe)
                continue
            rest = dataclasses.replace(
                email,
                to=_without(email.to, suppressed),
                cc=_without(email.cc, suppressed),
                bcc=_without(email.bcc, suppressed),
            )
            _log.info(
                "suppressed recipients dropped",
                extra={
                    "action": "recipients_suppressed",
                    "message_id": ready.claim.id,
                    "count": len(dropped),
                },
            )
            kept.append((dataclasses.replace(ready, email=rest, dropped=dropped), slot))
        return kept, barred

    def _start(
        self,
        wave: list[tuple[_Ready, Slot | None]],
        marked: dict[tuple[int, str], datetime],
        now: datetime,
    ) -> None:
        """Hand each marked message of the wave to a send thread. After a failed exchange the
        same id can be queued under two claims; only the one whose mark applied is sent. Its
        attempt starts at its ``send_started_at``."""
        for ready, slot in wave:
            claim = ready.claim
            started_at = marked.get((claim.id, claim.claim_token))
            if started_at is None:
                _log.warning(
                    "lease lost before the send started; not sending",
                    extra={"action": "lease_lost", "message_id": claim.id},
                )
                if ready.probe is not None:  # the probe is gone: probe again after a pause
                    self.pauses.probe_lost(ready.probe)
                continue
            message = OutgoingMessage(
                id=claim.id,
                key=claim.key,
                category=claim.category,
                attempt=claim.attempt_count + 1,
                email=ready.email,
                claim_token=claim.claim_token,
            )
            started = time.monotonic()
            lease_ends = started + (claim.lease_expires_at - now).total_seconds()
            span = tracing.Attempt(message, ready.trace) if tracing.ENABLED else None
            send = self._send if span is None else span.run(self._send)
            future = self._pool.submit(send, message, slot, lease_ends)
            self._in_flight[(claim.id, claim.claim_token)] = _InFlight(
                claim=claim,
                started_at=started_at,
                future=future,
                deadline=started + self.config.send_timeout,
                probe=ready.probe,
                dropped=ready.dropped,
                trace=span,
            )
            future.add_done_callback(lambda _f: self._wake.set())

    def _send(
        self, message: OutgoingMessage, slot: Slot | None, deadline: float
    ) -> tuple[Outcome, float]:
        """Runs on a worker thread. A sender that raises is treated as ambiguous: the request
        may have left before the error. Returns the outcome and the call's seconds.

        A thread that starts after the claim's lease ran out (the process was frozen) does not
        send: another relay may have swept the row already."""
        if slot is not None and (late := self.limiter.wait(slot)) is not None:
            # later than its booking allows: sending now could crowd a second of the budget
            _log.warning(
                "send started %.3fs after its booked time; given back unsent",
                late,
                extra={"action": "send_slot_missed", "message_id": message.id},
            )
            return Disabled(
                code="send_slot_missed",
                message=f"the send thread started {late:.3f}s after its booked time",
            ), 0.0
        began = time.monotonic()
        if began >= deadline:
            return Disabled(code="lease_lost", message="lease expired before the send"), 0.0
        try:
            outcome: Outcome = self.sender.send(message)
        except Exception as exc:
            _log.exception(
                "sender raised", extra={"action": "sender_error", "message_id": message.id}
            )
            outcome = Ambiguous(code="sender_exception", message=f"{type(exc).__name__}: {exc}")
        return outcome, time.monotonic() - began

    def _collect(self, now: datetime) -> None:
        """Move finished sends, with the policy's decision, to the unsaved list, and react to
        what the provider said before anything more is claimed (a pause, a throttle)."""
        for key, flight in list(self._in_flight.items()):
            if flight.future.done():
                del self._in_flight[key]
                outcome, duration = flight.future.result()
                decision = _fitted(decide(outcome, flight.claim.state, now, self._rng))
                if isinstance(outcome, Disabled) and outcome.pause and outcome.scope != ACCOUNT:
                    # only this scope is paused: its message steps back in line until its probe
                    later = now + timedelta(seconds=self.config.pause_seconds)
                    decision = dataclasses.replace(decision, next_attempt_at=later)
                self._unsaved.append(
                    _Done(
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
                self._react(outcome, flight.probe)

    @tracing.settles
    def _save(
        self, conn: sa.Connection, batch: list[_Done], now: datetime, *, attempts: bool = True
    ) -> list[bool]:
        """Write each finished send's decision (guarded by its claim) and its attempt row;
        returns, per item, whether the decision applied."""
        if not batch:
            return []
        sent = store.finalize_sent_many(
            conn,
            [
                (d.claim.id, d.claim.claim_token, d.decision.provider_message_id)
                for d in batch
                if d.decision.action is Action.SENT
            ],
            now=now,
        )
        applied = [
            (done.claim.id, done.claim.claim_token) in sent
            if done.decision.action is Action.SENT
            else store.apply_decision(conn, done.claim, done.decision, now)
            for done in batch
        ]
        if not attempts:
            return applied
        store.record_attempts(
            conn,
            (
                _attempt(done, self.relay_id, stale=not ok)
                for done, ok in zip(batch, applied, strict=True)
                # a suppressed message whose claim was gone: nothing was sent, nothing moved
                if ok or done.recorded is None
            ),
        )
        return applied

    def _announce_saved(self, batch: list[_Done], applied: list[bool]) -> None:
        for done, ok in zip(batch, applied, strict=True):
            self._announce(
                done.claim,
                done.decision,
                applied=ok,
                duration=done.duration,
                outcome=_done_outcome(done),
            )

    def _finalize(self) -> bool:
        """Save finished sends now, claiming nothing (drain, tests)."""
        now = self.clock()
        self._collect(now)
        if not self._unsaved:
            return False
        batch = list(self._unsaved)
        try:
            with self._transaction() as conn:
                applied = self._save(conn, batch, now)
        except sa.exc.DBAPIError as exc:
            if is_outage(exc):
                raise
            self._save_alone(batch, now)  # one that cannot be saved never holds back the rest
            return True
        del self._unsaved[: len(batch)]
        self._announce_saved(batch, applied)
        return True

    def _react(self, outcome: Outcome, probe: Scope | None) -> None:
        """Adapt the relay to what the provider said: slow down, pause, resume. Whatever a
        probe's outcome, the probe is over."""
        match outcome:
            case Transient(throttled=True):
                self.rate.on_throttle()
            case Disabled(pause=True, code=code, scope=scope):
                self._pause(scope, code)
            case Permanent(config_error=True, code=code):
                _log.error(
                    "sending is misconfigured: %s",
                    code,
                    extra={"action": "config_error", "code": code},
                )
        broken = isinstance(outcome, Ambiguous) and outcome.code == "sender_exception"
        self._sender_errors = self._sender_errors + 1 if broken else 0
        if self._sender_errors >= _SENDER_ERRORS_TO_PAUSE:
            self._pause(ACCOUNT, "sender_exception")
        if probe is None:
            return
        still = (isinstance(outcome, Disabled) and outcome.pause) or (broken and probe == ACCOUNT)
        if self.pauses.probe_ended(
            probe, paused=still, informative=not isinstance(outcome, Disabled) or still
        ):
            if probe == ACCOUNT:
                self.state = RelayState.RUNNING
                self._last_heartbeat = 0.0  # show the resumption in outbox_relays at once
            _log.warning(
                "sending works again; resuming (%s)",
                probe,
                extra={"action": "resumed", "scope": str(probe)},
            )

    def _pause(self, scope: Scope, code: str) -> None:
        first = self.pauses.pause(scope, code)
        _log.error(
            "sending paused (%s: %s); probing again in %gs",
            scope,
            code,
            self.config.pause_seconds,
            extra={
                "action": "paused" if first else "still_paused",
                "code": code,
                "scope": str(scope),
            },
        )
        if scope == ACCOUNT:
            self.state = RelayState.PAUSED
            self._last_heartbeat = 0.0  # show the pause in outbox_relays at once
            self._release_ready()
        elif self._ready:
            self._release_ready(scope)

    def _extend_leases(self, now: datetime) -> None:
        """Renew the leases this relay still needs: sends in flight within their deadline,
        finished sends not saved yet, claims waiting to start. A send past ``--send-timeout``
        is not renewed: its lease runs out and the sweep settles it as ambiguous."""
        half = timedelta(seconds=self.config.lease_seconds / 2)
        mono = time.monotonic()
        held: list[store.Claim] = []
        for flight in self._in_flight.values():
            if mono < flight.deadline:
                held.append(flight.claim)
            elif not flight.overdue:
                flight.overdue = True
                _log.error(
                    "send still running past --send-timeout; its lease is left to expire",
                    extra={"action": "send_overdue", "message_id": flight.claim.id},
                )
                hung = len(self._in_flight) - self._sending()
                if hung >= self.config.concurrency and not self.pauses.account_paused:
                    self._pause(ACCOUNT, "sender_hung")
        held += [done.claim for done in self._unsaved + self._stuck]
        held += [ready.claim for ready in self._ready]
        due = [claim for claim in held if claim.lease_expires_at - now < half]
        if not due:
            return
        until = now + timedelta(seconds=self.config.lease_seconds)
        kept: set[tuple[int, str]] = set()
        with self._transaction() as conn:
            for token, ids in _by_token(due).items():
                kept.update(
                    (id_, token)
                    for id_ in store.extend_lease(conn, ids=ids, claim_token=token, until=until)
                )

        def renewed(claim: store.Claim) -> store.Claim:
            if claim.lease_expires_at - now >= half or (claim.id, claim.claim_token) not in kept:
                return claim
            return dataclasses.replace(claim, lease_expires_at=until)

        for flight in self._in_flight.values():
            flight.claim = renewed(flight.claim)
        self._unsaved = [dataclasses.replace(d, claim=renewed(d.claim)) for d in self._unsaved]
        self._stuck = [dataclasses.replace(d, claim=renewed(d.claim)) for d in self._stuck]
        for ready in self._ready:
            ready.claim = renewed(ready.claim)
        for claim in due:
            if (claim.id, claim.claim_token) not in kept:
                _log.warning("lease lost", extra={"action": "lease_lost", "message_id": claim.id})

    def _sweep(self, now: datetime) -> bool:
        mono = time.monotonic()
        if mono - self._last_sweep < _SWEEP_INTERVAL or mono < self._sweep_from:
            return False
        self._last_sweep = mono
        with self._transaction() as conn:
            swept = store.sweep_expired_leases(conn, now=now, relay_id=self.relay_id, rng=self._rng)
        for lease, decision in swept:
            self._announce(
                lease.claim,
                decision,
                applied=True,
                swept=True,
                outcome=AttemptOutcome.LEASE_EXPIRED,
            )
        return self._reconcile(now) or bool(swept)

    def _reconcile(self, now: datetime) -> bool:
        """Settle the reconcile policy's ambiguous sends: those SES answered with its
        MessageId after all become sent (:func:`relay.store.resolve_confirmed`), then those
        no event named while the intake flowed past their window are requeued, once
        (:func:`relay.store.reconcile_unknown`). Every replica runs it, the guarded writes
        make racing ones harmless. A statement error is logged and tried again next
        interval: a broken reconcile must not stop sending."""
        mono = time.monotonic()
        if mono - self._last_reconcile < _RECONCILE_INTERVAL:
            return False
        self._last_reconcile = mono
        try:
            with self._transaction() as conn:
                confirmed = store.resolve_confirmed(conn, now=now, relay_id=self.relay_id)
                requeued = store.reconcile_unknown(conn, now=now, relay_id=self.relay_id)
        except sa.exc.DBAPIError as exc:
            if is_outage(exc):
                raise
            _log.error(
                "reconcile failed: %s",
                exc.orig if exc.orig is not None else exc,
                extra={"action": "reconcile_failed"},
            )
            return False
        for c in confirmed:
            _log.info(
                "sent: SES answered the ambiguous send with its MessageId after the sweep",
                extra={
                    "action": "reconcile_sent",
                    "message_id": c.id,
                    "provider_message_id": c.provider_message_id,
                },
            )
            signals.reconciled.send(
                self,
                message_id=c.id,
                category=c.category,
                result="sent",
                provider_message_id=c.provider_message_id,
            )
        for r in requeued:
            _log.warning(
                "requeued: no event for the ambiguous send while the intake flowed past its window",
                extra={"action": "reconcile_requeued", "message_id": r.id},
            )
            signals.reconciled.send(
                self,
                message_id=r.id,
                category=r.category,
                result="requeued",
                provider_message_id=None,
            )
        return bool(confirmed or requeued)

    def _expire(self, now: datetime) -> None:
        """Expire rows that are not due yet; due ones are expired by the claim itself."""
        if time.monotonic() - self._last_expire < _EXPIRE_INTERVAL:
            return
        with self._transaction() as conn:
            gone = store.expire(conn, now=now)
        self._last_expire = time.monotonic()
        self._announce_expired(gone)

    def _announce_expired(self, expired: list[store.Expired]) -> None:
        for gone in expired:
            _log.info("expired unsent", extra={"action": "expired", "message_id": gone.id})
            signals.expired.send(self, message_id=gone.id, category=gone.category)

    # -- heartbeat, drain, waiting ---------------------------------------------------------

    def _register(self) -> None:
        """Take this relay's row in outbox_relays. Raises ConfigurationError if a live relay
        (one that heartbeated within three heartbeat intervals, by the database's clock)
        already holds the relay id: two relays under one id would share one row."""
        try:
            holder = self._take_row()
        except sa.exc.IntegrityError:  # a relay with this id inserted its row just now
            holder = self._take_row()
        if holder is not None:
            age = (self.clock() - holder.heartbeat_at).total_seconds()
            self._drop_connection()  # run() ends here, before its own cleanup
            raise ConfigurationError(
                "--relay-id",
                f"{self.relay_id!r} is in use by a running relay on host {holder.host} "
                f"(pid {holder.pid}, {holder.state}, last heartbeat {age:.1f}s ago); give "
                "each relay its own id (or leave --relay-id unset)",
            )
        self._last_heartbeat = time.monotonic()
        self._announce_start()

    def _announce_start(self) -> None:
        """One line naming what this relay does: its sender and where it sends, its id and
        its database (the password masked); a warning if the sender delivers nothing."""
        where = getattr(self.sender, "where", None)
        details = where() if callable(where) else {}
        _log.info(
            "relay started",
            extra={
                "action": "started",
                "relay_id": self.relay_id,
                "sender_kind": self.sender.name,
                **details,
                "database": masked_url(self.engine.url),
            },
        )
        if getattr(self.sender, "delivers", True) is False:  # console, file: BaseSender.delivers
            _log.warning(
                "the %s sender delivers nothing: each message is marked sent but none leaves "
                "this machine; use --sender ses or smtp to deliver",
                self.sender.name,
                extra={"action": f"{self.sender.name}_sender"},
            )

    def _holds_row(self, conn: sa.Connection, now: datetime) -> bool:
        """Heartbeat the row this relay registered; False if it has none, or lost it."""
        return self._registered_at is not None and store.heartbeat_held(
            conn,
            relay_id=self.relay_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self._registered_at,
            now=now,
            state=self.state,
        )

    def _take_row(self) -> store.RelayHolder | None:
        """Register; returns the live holder of the relay id instead, if there is one."""
        now = self.clock()
        with self._transaction() as conn:
            if self._holds_row(conn, now):
                return None  # registered already (a heartbeat before run() did it)
            holder = self._register_row(conn, now)
            if holder is not None:
                return holder
            if conn.dialect.name in ("mysql", "mariadb"):
                level = conn.get_isolation_level()
                if level != READ_COMMITTED:
                    _log.warning(
                        "engine runs at %s: concurrent claims will wait on gap locks; "
                        "build it with relay.db.make_engine (READ COMMITTED)",
                        level,
                        extra={"action": "isolation_level"},
                    )
        self._registered_at = now
        self._unseen_registers.clear()
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
            unseen=tuple(self._unseen_registers),
        )
        if holder is None:
            self._unseen_registers = [*self._unseen_registers[-15:], now]
        return holder

    def _heartbeat(self, now: datetime) -> None:
        """Show this relay alive on its row. If the row is gone, register again; if another
        relay with this id took it over (this one looked dead: frozen, or cut off from the
        database, for three heartbeat intervals), stop: one id, one relay."""
        if time.monotonic() - self._last_heartbeat < self.config.heartbeat_interval:
            return
        holder = None
        with self._transaction() as conn:
            mine = self._holds_row(conn, now)
            if not mine:
                holder = self._register_row(conn, now)
        self._last_heartbeat = time.monotonic()
        if mine:
            return
        if holder is None:
            self._registered_at = now
            self._unseen_registers.clear()
            return
        self._registered_at = None
        _log.error(
            "relay id %r taken over by a relay on host %s (pid %s); stopping",
            self.relay_id,
            holder.host,
            holder.pid,
            extra={"action": "relay_id_taken", "relay_id": self.relay_id},
        )
        self.request_stop()

    def _deregister(self) -> None:
        if self._registered_at is not None:
            with self._transaction() as conn:
                store.stop_held(
                    conn,
                    relay_id=self.relay_id,
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    started_at=self._registered_at,
                    now=self.clock(),
                )
        _log.info("relay stopped", extra={"action": "stopped", "relay_id": self.relay_id})

    def _drain(self) -> None:
        """Stop claiming, give back unstarted claims, let sends in flight finish and finalize
        them within ``drain_seconds``."""
        self.state = RelayState.DRAINING
        deadline = time.monotonic() + self.config.drain_seconds
        _log.info(
            "draining",
            extra={"action": "draining", "in_flight": len(self._in_flight)},
        )
        self._with_db(self._release_ready)
        while self._in_flight or self._unsaved:
            self.loop_at = time.monotonic()
            if time.monotonic() >= deadline:
                _log.error(
                    "drain deadline passed with sends in flight; their leases will expire",
                    extra={"action": "drain_timeout", "in_flight": len(self._in_flight)},
                )
                return
            if self._with_db(self._drain_step) is None:
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            if self._in_flight:
                self._wake.wait(0.05)
                self._wake.clear()
        _log.info("drained", extra={"action": "drained"})

    def _drain_step(self) -> None:
        self._finalize()
        self._extend_leases(self.clock())

    def _release_ready(self, scope: Scope | None = None) -> None:
        """Give back the claims waiting to start: all of them (drain, an account pause), or
        those of one paused scope, which step back in line until its next probe."""
        if scope is None:
            chosen, later = self._ready, None
        else:
            chosen = [r for r in self._ready if scope.holds(_scopes(r.email))]
            later = self.clock() + timedelta(seconds=self.config.pause_seconds)
        if not chosen:
            return
        now = self.clock()
        with self._transaction() as conn:
            for token, ids in _by_token(r.claim for r in chosen).items():
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
            signals.released.send(self, message_id=claim.id, category=claim.category)
            if ready.probe is not None:
                self.pauses.probe_lost(ready.probe)
        gone = {id(r) for r in chosen}
        self._ready = [r for r in self._ready if id(r) not in gone]

    def _idle(self) -> bool:
        """Nothing held, and the last claim was not cut short by the rate limit."""
        busy = bool(self._in_flight or self._ready or self._unsaved or self._stuck)
        # paused: idle once a probe found nothing due (a paused scope's held messages are
        # not due; they wait for a later run)
        busy = busy or (self.pauses.account_paused and not self._probe_found_nothing)
        return not busy and self.limiter.available() >= 1

    def _wait(self) -> None:
        if self._ready or self.limiter.available() < 1:  # waiting for the rate limit only
            timeout = max(0.005, self.limiter.seconds_until_available())
        elif (probe_in := self.pauses.next_probe_in()) is not None and probe_in > 0:
            timeout = max(0.005, min(self.config.poll_interval, probe_in))
        else:
            timeout = self.config.poll_interval * self._rng.uniform(0.8, 1.2)
        self._wake.wait(timeout)
        self._wake.clear()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sa.Connection]:
        """One transaction on the loop's own connection. The connection is kept between
        passes (no pool checkout, no liveness ping per transaction) and dropped after any
        error, so the next transaction starts on a fresh, pinged one."""
        if self._conn is None:
            conn = self.engine.connect()
            try:
                _end_idle_transactions(conn, self.config.lease_seconds)
                if self._db_clock is not None:
                    self._db_clock.sample(conn)  # a new connection may be a new server
                    conn.commit()
            except BaseException:
                _discard(conn)
                raise
            self._conn = conn
        try:
            with self._conn.begin():
                yield self._conn
        except BaseException:
            self._drop_connection()
            raise

    def _drop_connection(self) -> None:
        """Close the loop's connection for good (it carries a session setting of its own, so
        it does not go back to the pool)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                _discard(conn)
            with contextlib.suppress(Exception):
                conn.close()

    def _with_db(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; on a database error log it and return None (the loop backs off)."""
        try:
            result = fn()
        except sa.exc.DBAPIError as exc:
            self._db_failures += 1
            self._sweep_from = math.inf  # no sweep until reconnected and the others had time
            _log.warning(
                "database error: %s",
                exc.orig if exc.orig is not None else exc,
                extra={"action": "db_error", "failures": self._db_failures},
            )
            return None
        if self._db_failures:
            # back after an outage: the other relays are coming back too (each within one
            # backoff, at most a heartbeat interval), and need a moment to save and renew
            # what they hold before anyone sweeps it
            self._sweep_from = time.monotonic() + 2 * self.config.heartbeat_interval
        self._db_failures = 0
        return True if result is None else result

    def _db_backoff(self) -> float:
        """Jittered exponential, at most a heartbeat interval: after an outage every relay is
        back within one, before anyone's sweep (which waits two) can take its sends."""
        cap = min(30.0, self.config.heartbeat_interval)
        return retry_delay(self._db_failures, self._rng, cap=cap)

    def _announce(
        self,
        claim: store.Claim,
        decision: Decision,
        *,
        applied: bool,
        swept: bool = False,
        duration: float | None = None,
        outcome: AttemptOutcome | None = None,
    ) -> None:
        extra = {
            "action": _LOG_ACTIONS[decision.action] if applied else "stale_finalize",
            "message_id": claim.id,
            "code": decision.code,
            "swept": True if swept else None,
        }
        if not applied:
            _log.warning(
                "claim no longer held; attempt recorded, message left as it is",
                extra={**extra, "provider_message_id": decision.provider_message_id},
            )
            signals.stale_finalize.send(
                self,
                message_id=claim.id,
                category=claim.category,
                code=decision.code,
                provider_message_id=decision.provider_message_id,
                duration=duration,
                outcome=outcome,
            )
            return
        level = logging.WARNING if decision.action is Action.HOLD else logging.INFO
        _log.log(level, _LOG_ACTIONS[decision.action], extra=extra)
        _SIGNALS[decision.action].send(
            self,
            message_id=claim.id,
            category=claim.category,
            code=decision.code,
            provider_message_id=decision.provider_message_id,
            duration=duration,
            outcome=outcome,
        )


def _discard(conn: sa.Connection) -> None:
    """Invalidate ``conn``, so its session settings never go back to the pool; except in a pool
    of one shared connection (``StaticPool``, ``SingletonThreadPool``: SQLite ``:memory:``, a
    test's database, not a relay's), where that would destroy the database it holds."""
    if not isinstance(conn.engine.pool, StaticPool | SingletonThreadPool):
        conn.invalidate()


def _end_idle_transactions(conn: sa.Connection, seconds: float) -> None:
    """Have the server end this session's transaction if it sits idle for ``seconds`` (the
    lease). A relay frozen inside a transaction (a stopped process, a paused VM) would
    otherwise keep its rows locked, and out of every other relay's sweep, until it woke.
    PostgreSQL: ``idle_in_transaction_session_timeout``; MariaDB: ``idle_transaction_timeout``.
    MySQL has no such setting: there the session's ``wait_timeout`` (idle, in a transaction or
    not) is set to the lease, which the loop's connection never reaches while the relay is
    alive (it runs a statement at least every heartbeat interval, a quarter of the lease). The
    relay's own transactions last milliseconds."""
    timeout = max(1, math.ceil(seconds))
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(
            f"SET idle_in_transaction_session_timeout = {max(1, int(seconds * 1000))}"
        )
    elif getattr(conn.dialect, "is_mariadb", False):
        conn.exec_driver_sql(f"SET SESSION idle_transaction_timeout = {timeout}")
    elif conn.dialect.name == "mysql":
        conn.exec_driver_sql(f"SET SESSION wait_timeout = {timeout}")
    conn.commit()


def _storable(value: str | None) -> str | None:
    """``value`` as text every database stores: a NUL (which PostgreSQL text refuses) and a
    lone surrogate (which no UTF-8 column takes) written as escapes. A sender's error text or
    provider id is not ours to trust, and a value the row cannot hold would leave a send that
    was accepted unsaved, to be swept as ambiguous."""
    if value is None or (value.isprintable() and value.isascii()):
        return value
    if "\x00" in value:
        value = value.replace("\x00", "\\x00")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def _fitted(decision: Decision) -> Decision:
    """``decision`` with its code, message and provider id cut to what their columns hold (a
    provider id too long for its column, or one with characters no column stores, is kept
    whole in the message, escaped)."""
    code = _storable(decision.code)
    text = _storable(decision.message)
    provider_id = decision.provider_message_id
    stored_id = _storable(provider_id)
    if provider_id is not None and (stored_id != provider_id or len(provider_id) > _ID_CHARS):
        text = f"provider message id: {stored_id}; {text or ''}"
        provider_id = None if stored_id is None else stored_id[:_ID_CHARS]
    if code is not None and len(code) > _CODE_CHARS:
        code = code[:_CODE_CHARS]
    if text is not None and len(text) > _TEXT_CHARS:
        text = text[:_TEXT_CHARS]
    if (code, text, provider_id) == (
        decision.code,
        decision.message,
        decision.provider_message_id,
    ):
        return decision
    return dataclasses.replace(decision, code=code, message=text, provider_message_id=provider_id)


def _outcome_name(outcome: Outcome | None) -> AttemptOutcome:
    return AttemptOutcome.INVALID_PAYLOAD if outcome is None else _OUTCOME_NAMES[type(outcome)]


def _done_outcome(done: _Done) -> AttemptOutcome:
    return done.recorded if done.recorded is not None else _outcome_name(done.outcome)


def _without(addresses: Iterable[str], suppressed: set[str]) -> tuple[str, ...]:
    return tuple(a for a in addresses if address_key(a) not in suppressed)


def _attempt(done: _Done, relay_id: str, *, stale: bool) -> store.AttemptRecord:
    name = _done_outcome(done)
    return store.AttemptRecord(
        message_id=done.claim.id,
        claim_token=done.claim.claim_token,
        relay_id=relay_id,
        started_at=done.started_at,
        finished_at=done.finished_at,
        outcome=name.stale if stale else name,
        error_code=done.decision.code,
        error_message=done.decision.message,
        provider_message_id=done.decision.provider_message_id,
        dropped_recipients=",".join(done.dropped) or None,
    )


def _by_token(claims: Iterable[store.Claim]) -> dict[str, list[int]]:
    """Message ids grouped by the claim that holds them (one statement per claim)."""
    grouped: dict[str, list[int]] = {}
    for claim in claims:
        grouped.setdefault(claim.claim_token, []).append(claim.id)
    return grouped
