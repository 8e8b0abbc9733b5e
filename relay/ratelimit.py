"""The send-rate limit: recipients per second for all relays together, in every sliding
one-second window at the provider's door (the moment each provider call starts).

Every relay books its sends in one schedule kept in the database (``outbox_send_budget``, see
:mod:`relay.store`), under one lock, before it starts them; :class:`SendBudget` is the
arithmetic. Bookings are spaced over windows of one second plus ``SLACK``, and a send starts
at its booked time or up to ``LATE_START`` later, never later (its thread gives the message
back unsent): then no one-second window of real starts can hold more than the limit, however
many relays there are and however their threads are scheduled. The rest of the slack covers
what lies between the start of a provider call and the provider's door (building and signing
the request, the network) and the difference between two relays' clocks. The cost: under a
full backlog the relays together send ``limit / (1 s + SLACK)``, 95% of the limit.

* A send of at most the limit is booked at the earliest moment (not before any booking already
  made: the schedule only grows at its end) at which every window around it stays within the
  limit.
* A send of more recipients than the limit goes alone: nothing else is booked in any window
  that holds it, and it holds the budget for the ``recipients / limit`` seconds its recipients
  are worth, so the average over any stretch stays at the limit too. A limit below one per
  second is the same rule: at 0.25/s a one-recipient send holds the budget for four seconds.
* A relay books only what may start within ``HORIZON``; its send threads wait for their
  booked time. Relays booked as one schedule, so the number of live relays no longer matters.

Times are the database's (each relay's clock is anchored to it, :mod:`relay.clock`): every
relay compares the same bookings on the same clock. The clock error between two relays is
at most half the round trips of the queries that read the database's time.

:class:`RateController` adapts the limit a relay books with to the provider's answers: halved
on a throttling answer, 5% of it back per second without one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

__all__ = [
    "HORIZON",
    "IN_FLIGHT_LOOK",
    "IN_FLIGHT_WAIT",
    "LATE_START",
    "MAX_HANDOFF",
    "SHARED",
    "SLACK",
    "WINDOW",
    "Booking",
    "Planned",
    "RateController",
    "ScopedSend",
    "SendBudget",
    "Slot",
    "earliest_start",
    "merged",
    "occupation",
]

SHARED = ""  # the scope of --max-send-rate's budget (others: "key:..." and "identity:...")
WINDOW = timedelta(seconds=1)  # the provider counts recipients per second, sliding
SLACK = timedelta(milliseconds=50)  # bookings are spaced a window and this apart
LATE_START = timedelta(milliseconds=35)  # of the slack, what a send thread may start late by
HORIZON = timedelta(milliseconds=200)  # how far ahead of a send's start it is booked
_HANDOFF = 0.05  # seconds: the first guess of how long a booking takes to reach its thread
_HANDOFF_HALF_LIFE = 10.0  # seconds: how fast the longest handoff seen is forgotten
MAX_HANDOFF = 5.0  # seconds: the longest lead ever used (a frozen process is not a handoff)
_PRUNE_INTERVAL = 1.0  # seconds (monotonic) between deletions of bookings that no longer count
# How long a send whose scope has its most sends in flight steps back in line, per round of
# that scope's sends ahead of it: in flight is freed by sends ending, which no one can plan.
IN_FLIGHT_WAIT = timedelta(seconds=1)
# How long the claim leaves such a scope's other due rows alone: claiming them sooner would
# mostly send them back; later would leave its freed slots idle (claims sent back a second
# each this often bound the churn to a few a second)
IN_FLIGHT_LOOK = timedelta(seconds=0.25)


@dataclass(frozen=True, kw_only=True, slots=True)
class Slot:
    """When a send thread may call the provider: ``start``, on this process's monotonic clock.
    ``planned`` is when it was booked (the handoff to the thread is measured from it)."""

    planned: float
    start: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Booking:
    """Sends of ``recipients`` in all booked to start at ``start``. ``until`` is when its
    hold on the whole budget ends: ``start`` itself, except for a send over the limit."""

    start: datetime
    recipients: int
    until: datetime


def occupation(recipients: int, limit: float) -> timedelta:
    """How long after its start a send holds the whole budget: not at all within the limit;
    over it, the ``recipients / limit`` seconds its recipients are worth, less the window
    that holds its start (so the next send waits that long plus a window)."""
    if recipients <= limit:
        return timedelta(0)
    return timedelta(microseconds=math.ceil(recipients * 1_000_000 / limit)) - WINDOW


def earliest_start(
    booked: Sequence[Booking],
    recipients: int,
    *,
    limit: float,
    now: datetime,
    span: timedelta,
) -> datetime:
    """The earliest moment, no earlier than ``now`` nor than the last booking, at which a send
    of ``recipients`` keeps every window of ``span`` within ``limit``.

    ``booked`` is in start order. As nothing is booked after the new send, the windows that
    hold it hold only bookings within ``span`` before it: it may start once the bookings in
    that stretch, newest first, leave room for it, and once every send over the limit has
    held the budget for its time and a window more. A send of the limit or more needs an
    empty stretch."""
    start = now
    if booked:
        start = max(start, booked[-1].start)
    room = max(0.0, limit - recipients)
    used = 0
    full = False
    for booking in reversed(booked):
        if booking.until > booking.start:
            start = max(start, booking.until + span)
        if full:
            continue
        used += booking.recipients
        if used > room:  # this one and everything before it must be out of the stretch
            start = max(start, booking.start + span)
            full = True
    return start


def merged(bookings: Iterable[Booking]) -> list[Booking]:
    """Bookings with the same start and end as one (fewer rows; the same schedule)."""
    out: list[Booking] = []
    for booking in bookings:
        last = out[-1] if out else None
        if last is not None and (last.start, last.until) == (booking.start, booking.until):
            out[-1] = Booking(
                start=last.start, recipients=last.recipients + booking.recipients, until=last.until
            )
        else:
            out.append(booking)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ScopedSend:
    """A send to plan: ``recipients``, and the budgets it is booked in (``SHARED`` first when
    there is a shared limit) with each one's rate; ``caps`` are the scopes it belongs to that
    have a most sends in flight, with that most."""

    recipients: int
    rates: tuple[tuple[str, float], ...] = ()
    caps: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Planned:
    """What :meth:`SendBudget.plan_scoped` made of one send: a ``start`` when it may start
    then, with its ``bookings`` (scope, booking; none when no budget of its has a rate); else
    ``kept`` in the queue for a slot of a scope at its most sends in flight; else
    ``wait_until``, when it goes back in line because a scope of its own is at its limit.
    None of these: the shared budget is full, so it and every later send wait (the shared
    schedule keeps their order)."""

    start: datetime | None = None
    bookings: tuple[tuple[str, Booking], ...] = ()
    wait_until: datetime | None = None
    kept: bool = False  # waits in the queue for a slot of its capped scope
    held_by: str | None = None  # the scope that held it back
    retry_at: datetime | None = None  # when that scope may have room: look at it again then


def _booking(start: datetime, recipients: int, limit: float) -> Booking:
    return Booking(start=start, recipients=recipients, until=start + occupation(recipients, limit))


def _append(schedule: list[Booking], booking: Booking) -> None:
    schedule[-1:] = merged([*schedule[-1:], booking])


class RateController:
    """The limit this relay books sends with, adapted to throttling.

    ``total`` is ``--max-send-rate`` (None: no limit), the rate for all relays together. A
    throttling answer halves this relay's limit; every second without one gives back 5% of
    the total (additive increase, multiplicative decrease). The budget is shared, so a
    throttled relay books less and leaves the rest to the others.
    """

    DECREASE = 0.5
    RECOVERY_PER_SECOND = 0.05
    FLOOR = 0.05  # never below 5% of the total: throttling must not stop sending outright

    def __init__(self, total: float | None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.factor = 1.0
        self._clock = clock
        self._last = clock()

    @property
    def rate(self) -> float | None:
        """Recipients per second this relay books with now (None: no limit)."""
        return None if self.total is None else self.total * self.factor

    def on_throttle(self) -> None:
        self.factor = max(self.FLOOR, self.factor * self.DECREASE)
        self._last = self._clock()

    def tick(self) -> None:
        now = self._clock()
        if self.factor < 1.0:
            self.factor = min(1.0, self.factor + self.RECOVERY_PER_SECOND * (now - self._last))
        self._last = now


class SendBudget:
    """This relay's side of the shared send budget: plans bookings, and remembers from its
    last look when the budget has room again, so the relay claims and looks no sooner.

    ``clock`` is the relay's shared (database) clock. The relay takes the budget's lock, reads
    the bookings since :meth:`lookback`, :meth:`plan`\\ s its unstarted messages and books
    them, in one transaction; each send thread then :meth:`wait`\\ s for its time.
    """

    def __init__(
        self,
        rate: RateController,
        *,
        clock: Callable[[], datetime],
        window: timedelta = WINDOW,
        slack: timedelta = SLACK,
        late_start: timedelta = LATE_START,
        horizon: timedelta = HORIZON,
        handoff: float = _HANDOFF,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if late_start > slack:
            raise ValueError("a send may start late by part of the slack at most")
        self._rate = rate
        self._clock = clock
        self.slack = slack
        self.late_start = late_start
        self.span = window + slack  # bookings are spaced over this, starts over the window
        self.horizon = horizon
        self._monotonic = monotonic
        self._next: datetime | None = None  # the earliest start found for one more send
        self._handoff = handoff  # seconds: the longest recent booking-to-thread handoff
        self._handoff_at = monotonic()
        self._last_prune = -math.inf
        self._holds: dict[str, datetime] = {}  # scope -> the latest it sent a claim back to

    @property
    def rate(self) -> float | None:
        """The limit this relay books with now (None: no limit, and no budget at all)."""
        return self._rate.rate

    @property
    def lead(self) -> timedelta:
        """How far after ``now`` a send is booked at the earliest: the time a booking takes to
        reach its send thread (the transaction's round trips and commit, the handoff), learnt
        from the last sends, so a thread waits for its slot rather than start late. Not
        capped by the horizon (which reaches that much further): with a database tens of
        milliseconds away, a capped lead would make every send miss its slot, for ever."""
        return timedelta(seconds=min(self._handoff, MAX_HANDOFF))

    @property
    def reach(self) -> timedelta:
        """How far ahead of ``now`` sends are booked: the horizon beyond the lead."""
        return self.lead + self.horizon

    def lookback(self, now: datetime) -> datetime:
        """Bookings whose hold on the budget ended before this cannot affect one at ``now``."""
        return now - self.span

    def plan(self, booked: Sequence[Booking], sizes: Sequence[int], now: datetime) -> list[Booking]:
        """Book, in order, as many of the sends of ``sizes`` recipients as may start within
        the horizon; the first that may not, and all after it, wait (the schedule keeps their
        order). ``booked`` is what all relays have booked, in start order."""
        limit = self.rate
        if limit is None:
            raise ValueError("no send limit: there is no budget to plan in")
        sends = [ScopedSend(recipients=n, rates=((SHARED, limit),)) for n in sizes]
        planned = self.plan_scoped({SHARED: list(booked)}, {}, sends, now)
        return [p.bookings[0][1] for p in planned]

    def plan_scoped(
        self,
        booked: dict[str, list[Booking]],
        in_flight: dict[str, int],
        sends: Sequence[ScopedSend],
        now: datetime,
    ) -> list[Planned]:
        """:meth:`plan` over several budgets at once: each send starts at the earliest moment
        every budget it belongs to has room (each budget's rule alone holds at any later
        moment, since nothing is booked after it), and takes a slot of each scope with a most
        sends in flight. A send its own scope holds back goes back in line until that scope
        has room (its rate: spaced after what the scope sent back before, so each goes back
        about once), or, up to the scope's cap of sends in flight, waits in the queue for a
        slot; the sends after it go on. One the shared budget holds back stops the plan, as
        :meth:`plan` does. ``booked`` and ``in_flight``
        are every relay's, by scope; both are updated as sends are planned."""
        floor, reach = now + self.lead, now + self.reach
        self._holds = {s: t for s, t in self._holds.items() if t > now}
        kept: dict[str, int] = {}  # sends waiting in the queue for a capped scope's slot
        out: list[Planned] = []
        for send in sends:
            full = next((s for s, cap in send.caps if in_flight.get(s, 0) >= cap), None)
            if full is not None:
                # up to its cap wait in the queue and start as soon as a send of the scope
                # ends (nobody can plan when); the rest go back in line for a while
                kept[full] = kept.get(full, 0) + 1
                look = now + IN_FLIGHT_LOOK
                if kept[full] <= dict(send.caps)[full]:
                    out.append(Planned(kept=True, held_by=full, retry_at=look))
                else:
                    until = now + IN_FLIGHT_WAIT
                    out.append(Planned(wait_until=until, held_by=full, retry_at=look))
                continue
            starts = {
                scope: earliest_start(
                    booked.setdefault(scope, []),
                    send.recipients,
                    limit=rate,
                    now=floor,
                    span=self.span,
                )
                for scope, rate in send.rates
            }
            start = max(starts.values(), default=floor)
            if starts.get(SHARED, floor) > reach:
                self._next = starts[SHARED]
                break
            rates = dict(send.rates)
            if start > reach:  # its own scope is at its rate: the next of that scope after it
                scope = max(starts, key=lambda s: starts[s])
                opening = max(now, starts[scope] - self.reach)  # the scope's next room
                _append(booked[scope], _booking(start, send.recipients, rates[scope]))
                step = timedelta(seconds=send.recipients / rates[scope])
                after = self._holds[scope] + step if scope in self._holds else now
                until = max(now, start - self.reach, after)
                self._holds[scope] = until
                out.append(Planned(wait_until=until, held_by=scope, retry_at=opening))
                continue
            bookings = tuple((s, _booking(start, send.recipients, rates[s])) for s in starts)
            for scope, booking in bookings:
                _append(booked[scope], booking)
            for scope, _cap in send.caps:
                in_flight[scope] = in_flight.get(scope, 0) + 1
            out.append(Planned(start=start, bookings=bookings))
        else:
            if SHARED in booked and self.rate is not None:
                self._next = earliest_start(
                    booked[SHARED], 1, limit=self.rate, now=floor, span=self.span
                )
        return out

    def available(self) -> float:
        """How many sends the relay may claim now: none while its last look found the budget
        full beyond the horizon; else what the horizon (and the slack) holds at the limit."""
        limit = self.rate
        if limit is None:
            return math.inf
        if self._next is not None and self._next > self._clock() + self.reach:
            return 0.0
        return float(max(1, math.ceil(limit * (self.horizon + self.slack).total_seconds())))

    def seconds_until_available(self) -> float:
        """How long until the budget may have room within the horizon (0: look now)."""
        if self.rate is None or self._next is None:
            return 0.0
        return max(0.0, (self._next - self.reach - self._clock()).total_seconds())

    def prune_due(self, now: datetime) -> datetime | None:
        """Once a second: the cut-off before which bookings may be deleted (None: not now)."""
        mono = self._monotonic()
        if mono - self._last_prune < _PRUNE_INTERVAL:
            return None
        self._last_prune = mono
        return self.lookback(now)

    def wait(self, slot: Slot) -> float | None:
        """On a send thread: sleep until the send's booked start. Returns None when the send
        may start, or how many seconds late the thread is when that is more than
        ``late_start`` allows: then the send must not start."""
        mono = self._monotonic()
        faded = self._handoff * 0.5 ** ((mono - self._handoff_at) / _HANDOFF_HALF_LIFE)
        self._handoff, self._handoff_at = max(mono - slot.planned, faded), mono
        if slot.start > mono:
            time.sleep(slot.start - mono)
        late = self._monotonic() - slot.start
        return late if late > self.late_start.total_seconds() else None
