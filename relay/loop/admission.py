"""Admission filters between a claim and its send: pauses, the shared budget, suppressions.

Each filter takes what the stage before it let through and returns what goes on, the way a
middleware chain does; :class:`relay.loop.producer.Producer` runs them in one transaction.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from datetime import datetime

import sqlalchemy as sa

from outbox.message import Email
from outbox.schema import AttemptOutcome
from relay import store
from relay.config import valid_send_rate
from relay.limits import Limits
from relay.loop.pausing import scopes
from relay.loop.records import Done, Ready, fitted
from relay.pause import Admission, Pauses, Scope
from relay.policy import Action, Decision
from relay.ratelimit import SHARED, Booking, ScopedSend, SendBudget, Slot
from relay.recipients import address_key
from relay.senders import Sender

__all__ = ["BudgetFilter", "Deferred", "PauseFilter", "SuppressionFilter", "Wave", "total_rate"]

_log = logging.getLogger("relay")

_AUTO_RATE_FALLBACK = 1.0  # recipients/s when --max-send-rate auto cannot read the account

Wave = list[tuple[Ready, Slot | None]]  # messages to start, each with its slot (None: now)
Deferred = list[tuple[Ready, datetime]]  # messages back in line, each until when


class PauseFilter:
    """While a scope is paused its messages step back in line until its next probe; one of
    them is the probe."""

    def __init__(self, pauses: Pauses) -> None:
        self.pauses = pauses

    def admit(self, email: Email) -> tuple[bool, Scope | None, float]:
        """Whether ``email`` may go now, the scope it probes, and else how long it waits (at
        least a second: a scope whose probe is out would be claimed again at once)."""
        if not self.pauses:
            return True, None, 0.0
        admission, scope = self.pauses.admit(scopes(email))
        if admission is Admission.HOLD:
            return False, None, max(1.0, self.pauses.remaining(scopes(email)))
        return True, scope, 0.0


class BudgetFilter:
    """The send budgets all relays share: the shared one (``--max-send-rate``) and one per
    limited key or identity (``--key-limit``, ``--identity-limit``). Each message is booked in
    every budget it belongs to at the earliest time that keeps every second of each within its
    limit, and takes a slot of each scope with a most sends in flight, in the pass's
    transaction, under the budgets' one lock. A message its own scope holds back goes back in
    line (no attempt used) until that scope has room; the messages after it go on."""

    def __init__(
        self,
        limiter: SendBudget,
        relay_id: str,
        clock: Callable[[], datetime],
        limits: Limits | None = None,
    ) -> None:
        self.limiter = limiter
        self.relay_id = relay_id
        self._clock = clock
        self.limits = limits or Limits()
        self.retry: dict[str, datetime] = {}  # scopes at their limit this pass -> look again
        self.kept = 0  # claims the last pass kept in the queue for a send slot
        self._prune_before: datetime | None = None  # the pass's prune, due (see prune)

    def admissible(self, ready: list[Ready]) -> bool:
        return bool(ready) and self.limiter.available() >= 1

    def admit(self, conn: sa.Connection, ready: list[Ready]) -> tuple[Wave, Deferred]:
        """The first of ``ready`` the limits let start, in order, each with its slot (the
        rest wait for a later pass), and those their own scope sends back in line, each with
        when to come back."""
        shared = self.limiter.rate
        if shared is None and not self.limits:
            return [(r, None) for r in ready], []
        self.retry, self.kept, self._prune_before = {}, 0, None
        if not ready or self.limiter.available() < 1:
            return [], []
        store.lock_send_budget(conn)
        now, mono = self._clock(), time.monotonic()  # after the lock: it may have been waited for
        sends = [self._send(r, shared) for r in ready]
        rated = {scope for send in sends for scope, _ in send.rates}
        capped = {scope for send in sends for scope, _ in send.caps}
        booked = store.scoped_bookings(conn, since=self.limiter.lookback(now), scopes=rated)
        in_flight = store.send_slots_in_use(conn, scopes=capped)
        planned = self.limiter.plan_scoped(booked, in_flight, sends, now)
        by_scope: dict[str, list[Booking]] = {}
        slots: list[tuple[str, int, str]] = []
        wave: Wave = []
        deferred: Deferred = []
        for r, send, plan in zip(ready, sends, planned, strict=False):
            if plan.held_by is not None and plan.retry_at is not None:
                seen = self.retry.get(plan.held_by, plan.retry_at)
                self.retry[plan.held_by] = min(seen, plan.retry_at)
            if plan.kept:
                self.kept += 1  # stays in the queue
                continue
            if plan.wait_until is not None:
                deferred.append((r, plan.wait_until))
                continue
            assert plan.start is not None
            for scope, booking in plan.bookings:
                by_scope.setdefault(scope, []).append(booking)
            slots.extend((scope, r.claim.id, r.claim.claim_token) for scope, _ in send.caps)
            at = mono + (plan.start - now).total_seconds()
            wave.append((r, Slot(planned=mono, start=at) if plan.bookings else None))
        for scope, bookings in by_scope.items():
            store.book_sends(conn, relay_id=self.relay_id, bookings=bookings, scope=scope)
        store.take_send_slots(conn, slots=slots, now=now)
        self._prune_before = self.limiter.prune_due(now)
        return wave, deferred

    def prune(self, conn: sa.Connection) -> None:
        """Once a second, in the pass's transaction (under the lock :meth:`admit` took): the
        bookings past the budget's window, and the slots no longer held. Called once the
        pass's claims are written: a slot of a claim not written yet (PostgreSQL's claim is
        written after the filters) would look unheld and be deleted as it is taken."""
        cutoff, self._prune_before = self._prune_before, None
        if cutoff is not None:
            store.prune_send_budget(conn, before=cutoff)
            if self.limits:
                store.prune_send_slots(conn)

    def _send(self, ready: Ready, shared: float | None) -> ScopedSend:
        """``ready`` as the budgets see it: its recipients, its budgets and its caps."""
        scopes = self.limits.scopes(ready.claim.fairness_key, ready.email.sender)
        rates = [(SHARED, shared)] if shared is not None else []
        rates += [(name, limit.rate) for name, limit in scopes if limit.rate is not None]
        return ScopedSend(
            recipients=max(1, ready.claim.recipient_count),
            rates=tuple(rates),
            caps=tuple((n, limit.in_flight) for n, limit in scopes if limit.in_flight is not None),
        )


class SuppressionFilter:
    """Suppressed recipients leave the wave before its send-started mark, by one lookup for
    the whole wave. A message left with no recipient fails (``suppressed``), never sent; the
    stored payload is not changed, so a later attempt screens against its own time's list."""

    def __init__(self, pauses: Pauses) -> None:
        self.pauses = pauses

    @staticmethod
    def wanted(wave: Wave) -> list[tuple[int, list[str]]]:
        """What the screen looks up: each message of the wave with its recipients' keys."""
        return [(r.claim.id, [address_key(a) for a in r.email.recipients]) for r, _ in wave]

    def screen(self, conn: sa.Connection, wave: Wave, now: datetime) -> tuple[Wave, list[Done]]:
        """The wave to send, and the messages barred from it (to be saved as failed)."""
        if not wave:
            return wave, []
        wanted = self.wanted(wave)
        found = store.suppressed_among(conn, (a for _id, keys in wanted for a in keys))
        return self.apply(wave, found, now)

    def apply(self, wave: Wave, suppressed: set[str], now: datetime) -> tuple[Wave, list[Done]]:
        """:meth:`screen` with its lookup done (``suppressed``: the wave's listed addresses,
        as ``store.take_batch`` finds them in the claim's write): a message barred here is
        one the take left unmarked."""
        if not suppressed:
            return wave, []
        kept: Wave = []
        barred: list[Done] = []
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
                    Done(
                        claim=ready.claim,
                        started_at=None,
                        finished_at=now,
                        outcome=None,
                        decision=fitted(decision),
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


def _without(addresses: Iterable[str], suppressed: set[str]) -> tuple[str, ...]:
    return tuple(a for a in addresses if address_key(a) not in suppressed)


def total_rate(setting: float | str | None, sender: Sender) -> float | None:
    """The send rate ``--max-send-rate`` asks for (None: no limit); ``auto`` reads the
    account's from the sender, falling back to 1/s when it cannot."""
    if setting != "auto":
        return setting  # type: ignore[return-value]
    try:
        rate = sender.max_send_rate()
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
