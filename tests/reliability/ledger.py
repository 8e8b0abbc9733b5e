"""A delivery ledger that breaks things on purpose, then reconciles SES against the outbox.

One run: enqueue N messages across three categories (``fast``: policy hold; ``digest``:
policy resend; ``expiring``: hold, with an ``expires_at`` a few seconds out), start K real
``outbox-relay run --sender ses`` processes against moto behind the fault server of
:mod:`tests.support.ses`, inject the scenario's faults on a schedule, let every row settle,
stop the relays (SIGTERM: they must drain and exit 0), then compare what SES accepted (the
fault server's ledger: per outbox id, how many times moto took it) with the outbox rows.

Every message must be exactly one of:

* ``sent``: received exactly once (at least once under ``resend``), with the provider id SES
  returned for the last accepted request;
* ``unknown_outcome``: received at most once, its last attempt recorded under the claim that
  made it (claim token and relay of the row's claim, outcome ``ambiguous``/``lease_expired``);
* ``failed``: received zero times, an error code recorded;
* ``cancelled`` / ``expired``: received zero times; except resend mail, which goes back to
  ``retrying`` after an unanswered send (and can then be cancelled or expire): received at most
  as many times as it has unanswered attempts (``ambiguous``/``lease_expired``) recorded.

And ``unknown_outcome`` is bounded by what could be ambiguous: the sends in flight at each
fault (processing rows with ``send_started_at`` set, claimed by the killed/stopped relay, read
while it cannot move) plus the fault server's own ambiguous answers (hangs, resets, corrupt
TLS records) plus the requests SES accepted whose answer reached the relay only after its read
timeout (moto slowed down by a loaded machine: the fault server saw the acceptance, the relay
recorded a read timeout).

Scenarios (``--scenario``): ``clean`` (no fault), ``sigkill`` / ``sigterm`` (relays killed or
stopped mid-run, each replaced), ``ses_faults`` (the SES fault mix and a pause window),
``db_kill`` (every relay connection killed on the server), ``slow_sender`` (a relay stopped past
its lease), ``poison`` (payloads no sender can use), ``xmin`` (PostgreSQL: a transaction holding
the xmin horizon back), ``db_restart``, ``cancel``, ``combined`` (most of it in one run), and
``db_outage``, ``clock_skew``, ``tls_fault``, ``paused_set`` (below).

A database restart (``db_restart``, and once in ``combined``) is a real stop and start of the
server by a shell command (``--restart-command``; the tests read ``OUTBOX_TEST_POSTGRES_RESTART``
/ ``OUTBOX_TEST_MYSQL_RESTART``). The sends in flight at a restart are the rows whose send had
started and was not finalized at the last moment the harness could still read the database
(it polls while the server goes down), plus every send whose recorded start falls between that
moment and the moment the server dropped the harness's connection (each widened by a margin).

Operator cancels (``cancel``, ``combined``) go through the real ``outbox-relay cancel ID --yes``
while the relays run, aimed at pending rows (some at the head of the queue, so some lose the
race to a claim) and at rows already claimed or sent; what the CLI reported decides what the
reconciliation expects: reported cancelled -> ``cancelled``, received zero times; reported as
refused or moved -> not cancelled.

Four scenarios aim at one fault each:

* ``db_outage``: the relays reach the database through a TCP proxy of the harness's own
  (:class:`DatabaseProxy`, 127.0.0.1, a free port; the harness itself talks to the database
  directly). While sends are in flight it drops every proxied connection and refuses new ones
  for longer than the lease, then lets them through again, the server itself running on. No
  send SES accepted may end ``unknown_outcome`` (or be swept as ``lease_expired``): each
  relay saves what it finished before anyone sweeps it.
* ``clock_skew``: one relay's wall clock runs two minutes ahead, another's two minutes behind
  (libfaketime); nothing else goes wrong, so no lease may expire and nothing is ambiguous.
* ``tls_fault``: the fault server speaks TLS (the relays trust its certificate through
  ``AWS_CA_BUNDLE``) and answers a share of the sends, once moto took them, with a corrupt
  TLS record: each is ambiguous (hold mail parked as ``unknown_outcome``, never retried).
* ``paused_set``: a share of the mail is sent with the configuration set ``marketing``, which
  SES pauses for a window while the rest keeps flowing; the marketing mail is held, with no
  attempt used, and delivered once after the window; no relay pauses as a whole.

Delivery truth (``--events``): the fault server publishes, for every send moto accepted
(answered or not), the events SES would (Send, then Delivery) through SNS into an SQS queue on
moto, and the relays read it (``run`` gives each ``outbox-relay run`` an
``--events-queue-url``; ``process`` runs one ``outbox-relay events`` beside them). The
enqueue adds a fourth category, ``reconcile`` (policy reconcile, a window of
``RECONCILE_AFTER`` seconds instead of 15 minutes). After the chaos the faults end, a trickle
of new mail (one every ``TICK_INTERVAL`` s: production traffic, whose events prove the intake
flows past each window; sparser than the intake's long poll, so a receive can find the queue
empty, the sweep's proof that no older event still waits) runs until the intake and the
reconcile sweeps owe nothing more, and the reconciliation adds, per ambiguous send (an
unanswered attempt of hold or reconcile mail, told apart by its row and claim token, which
the SES request carries as the ``outbox_attempt`` tag):

* it reached SES (the fault server saw moto accept that claim token's request): the row is
  ``sent`` with the MessageId moto gave that request, received once, never requeued;
* it did not, reconcile mail: requeued once (attempt ``reconcile:requeued``), then received
  exactly once; hold mail: still ``unknown_outcome``, for a human;
* every event published is one ``outbox_events`` row, none malformed, the dead-letter queue
  empty, and every sent row whose Delivery event (of the send whose id it holds) was published
  is ``delivered``.

``reconcile`` is the scenario made for it: a burst of SES faults (``FAULT_BURST`` seconds,
shorter than the window, so each requeue is sent after it) with resets before forwarding
(ambiguous sends SES never took, the ones reconcile requeues), then a SIGKILL; the events are
on (``run``) unless ``--events`` says otherwise, off for every other scenario.
``--event-faults`` also breaks the event stream: every event published a second late, a share
duplicated, a share of sends with their Send event last, and all the events of a share of the
sends SES *answered* dropped (of hold and resend mail only). A send whose events are lost and
whose answer was lost too looks to reconcile exactly like a send that never reached SES: it
would send it again. That is the window's inherent risk (``reconcile_after`` must outlast the
intake's worst delay; an event SES never publishes it cannot cover), so the run does not lose
the events of reconcile mail, and hold mail whose events were lost stays ``unknown_outcome``.

``--sender fake`` runs the relays with :class:`relay.testing.FakeSender` (no latency, a shared
record of every send) instead of SES through moto: the throughput of the relay and the database
alone, still reconciled per row (the xmin factor is measured this way).

Run alone::

    python -m tests.reliability.ledger --database-url URL --messages 3000 --relays 3 \\
        --scenario sigkill
    python -m tests.reliability.ledger --database-url URL --messages 600 --scenario reconcile \\
        --events process --event-faults
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from outbox import Category, Outbox, migrations
from outbox.schema import (
    attempts,
    events,
    intakes,
    messages,
    operator_actions,
    relays,
    suppressions,
)
from relay.db import READ_TIMEOUT, make_engine
from relay.store import RECEIVE_AFTER_HEARTBEAT
from relay.testing import read_deliveries
from tests.support.clocks import shifted
from tests.support.factories import email
from tests.support.relays import FAKE_SENDER, RELAY, RelayProc, clean_env, spawn, statuses
from tests.support.ses import FaultPlan, FaultServer, MotoSes, SendRequest, aws_env
from tests.support.ses_events import EventQueue
from tests.support.tls import make_certificate
from tests.support.waiting import wait_for

FAST = Category(name="fast", backoff_base=0.2, backoff_cap=1.0)  # hold
DIGEST = Category(name="digest", backoff_base=0.2, backoff_cap=1.0, ambiguity="resend")
EXPIRING = Category(name="expiring", backoff_base=0.2, backoff_cap=1.0)  # hold, expires_at
RECONCILE_AFTER = 10.0  # seconds: the reconcile category's window (15 minutes in production)
RECONCILE = Category(
    name="reconcile",
    backoff_base=0.2,
    backoff_cap=1.0,
    ambiguity="reconcile",
    reconcile_after=RECONCILE_AFTER,
)
OUTBOX = Outbox(categories=[FAST, DIGEST, EXPIRING, RECONCILE])
CATEGORIES = ("fast", "digest", "expiring")  # the enqueue's rotation without the events
EVENT_CATEGORIES = (*CATEGORIES, "reconcile")  # and with them
HELD = frozenset({"fast", "expiring", "reconcile"})  # an ambiguous send is parked, not resent
SETTLED = frozenset({"sent", "failed", "unknown_outcome", "cancelled", "expired"})
AMBIGUOUS_KINDS = frozenset({"hang", "reset", "tls_corrupt"})  # SES took it, unheard
UNHEARD_KINDS = AMBIGUOUS_KINDS | {"reset_before"}  # and the one SES never took
# attempts whose send may have reached SES without an answer
UNANSWERED = frozenset({"ambiguous", "lease_expired", "stale:ambiguous"})
SCENARIOS = (
    "clean",
    "sigkill",
    "sigterm",
    "ses_faults",
    "db_kill",
    "slow_sender",
    "poison",
    "xmin",
    "db_restart",
    "cancel",
    "combined",
    "db_outage",
    "clock_skew",
    "tls_fault",
    "paused_set",
    "reconcile",
)
SENDERS = ("ses", "fake")
# off; on in every relay (run --events-queue-url); one outbox-relay events process beside them
EVENT_MODES = ("off", "run", "process")
SEND_TIMEOUT = 2.0
LEASE = 5.0
POLL = 0.05  # seconds between two looks while waiting for something
BENIGN_ERRORS = ("BrokenPipeError", "ConnectionResetError")
SES_FAULT_MIX = {"throttle": 0.10, "server_error": 0.05, "hang": 0.02, "reset": 0.01}
PAUSE_WINDOW = 2.0  # seconds SES answers every send with SendingPausedException
# a send whose start was stamped this long before the last read may have committed after it
RESTART_MARGIN_BEFORE = 0.2
# a server closes its connections one by one: one may commit this long after ours was dropped
RESTART_MARGIN_AFTER = 0.1
RESTART_TIMEOUT = 120.0  # seconds a restart command, and the server coming back, may take
OUTAGE_SECONDS = LEASE + 3.0  # db_outage: longer than the lease
CLOCK_OFFSETS = ("+120s", "-120s")  # clock_skew: the wall clocks of the first two relays
TLS_FAULT_MIX = {"tls_corrupt": 0.03}
PAUSED_SET = "marketing"  # paused_set: the configuration set SES pauses
PAUSED_SET_WINDOW = 4.0  # seconds it stays paused
# reconcile: a burst of SES faults with resets before forwarding (ambiguous, never reached
# SES), shorter than the window, so every requeue is sent after it: a requeued row that came
# back ambiguous would rightly wait for a human, and the run would prove nothing more
RECONCILE_FAULT_MIX = {
    "throttle": 0.10,
    "server_error": 0.05,
    "hang": 0.04,
    "reset": 0.02,
    "reset_before": 0.12,
}
FAULT_BURST = RECONCILE_AFTER - 2.0  # seconds
# seconds between two messages of the trickle after the chaos: longer than the intake's long
# poll (2 s here), so a receive can come back empty, which is what proves to the reconcile
# sweep that no older event still waits in the queue
TICK_INTERVAL = 3.0
# seconds the intake and the reconcile sweeps may take to owe nothing more after the chaos
# A killed relay's intake replica may have died holding a held send's own event: the reconcile
# sweep waits until another replica found the queue empty that long after its last heartbeat
# (plus the visibility timeouts), so the harness waits for that too.
TRUTH_TIMEOUT = 60 + 4 * RECONCILE_AFTER + RECEIVE_AFTER_HEARTBEAT
# --event-faults: how the event stream is broken (see the module docstring)
EVENTS_DELAY = 1.0  # seconds between SES taking a send and its events being published
EVENTS_DUPLICATE = 0.1  # share of events published twice
EVENTS_REORDER = 0.1  # share of sends whose Send event comes after the others
EVENTS_DROP_ANSWERED = 0.3  # share of answered sends (hold, resend mail) whose events are lost


@dataclass
class Summary:
    scenario: str
    backend: str
    messages: int
    relays: int
    runtime: float = 0.0
    delivered: int = 0  # distinct messages SES accepted at least once
    accepted: int = 0  # every acceptance, duplicates included
    duplicates: int = 0  # extra acceptances of hold mail: must be 0
    resend_duplicates: int = 0  # extra acceptances of resend mail: allowed
    lost: int = 0  # rows not accounted for by SES as their status says: must be 0
    unknown: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    # resend mail cancelled or expired after an unanswered send that SES had in fact accepted
    ended_after_unanswered: int = 0
    sent: int = 0
    in_flight_at_faults: list[int] = field(default_factory=list)
    ambiguous_faults: int = 0  # hangs and resets the fault server answered
    slow_answers: int = 0  # read timeouts on requests the fault server passed (moto too slow)
    requests: Counter[str] = field(default_factory=Counter)
    restarts: int = 0
    sender: str = "ses"
    db_restarts: int = 0  # real database server restarts (the server's start time changed)
    restart_seconds: list[float] = field(default_factory=list)  # command start -> accepting
    restart_windows: list[RestartWindow] = field(default_factory=list)
    cancels: dict[int, str] = field(default_factory=dict)  # id -> what the CLI reported
    notes: list[str] = field(default_factory=list)
    xmin_held: bool | None = None  # xmin: the open transaction still held the horizon at the end
    throughput: float = 0.0  # SES requests per second, first to last
    frozen_claims: dict[int, str] = field(default_factory=dict)  # slow_sender: id -> token
    stale_finalized: int = 0  # frozen claims whose late finalize was recorded as an attempt
    sent_after_sweep: int = 0  # frozen claims whose request reached SES after the sweep
    lease_expired: int = 0  # lease_expired attempts: sweeps of a send that had started
    # db_outage: the cut (monotonic start and end), what it dropped and refused, the sends in
    # flight it froze, and rows SES accepted whose outcome was lost all the same (parked
    # unknown_outcome or swept as lease_expired): must be 0
    outage: tuple[float, float] | None = None
    dropped_connections: int = 0
    refused_connections: int = 0
    outage_in_flight: frozenset[int] = frozenset()
    outage_in_flight_accepted: int = 0  # of those, SES took (the relays had to keep them)
    accepted_during_outage: int = 0  # SES acceptances that arrived while the database was cut
    accepted_unknown: int = 0
    # clock_skew: SES requests per offset, in whole minutes, of the signer's clock
    signing_offsets: Counter[int] = field(default_factory=Counter)
    tls_faults: int = 0  # tls_fault: sends answered with a corrupt TLS record
    tls_held: int = 0  # of those, hold mail (each must end unknown_outcome)
    # paused_set: the pause window (monotonic start and end), the mail of the paused set,
    # what SES took during the window, and the relay states seen in outbox_relays meanwhile
    window: tuple[float, float] | None = None
    marketing: frozenset[int] = frozenset()  # rows sent with the paused configuration set
    marketing_before: int = 0  # of those, SES took before the window
    marketing_after: int = 0  # of those, SES took after the window
    marketing_refused: int = 0  # sends the paused set refused (the relays' probes)
    window_marketing_accepted: int = 0  # must be 0
    window_other_sends: int = 0  # other mail SES accepted during the window
    relay_states: Counter[str] = field(default_factory=Counter)
    # delivery truth (--events): the intake's shape, the trickle after the chaos, how long the
    # intake and the reconcile sweeps took to owe nothing more, and what became of the
    # ambiguous sends of hold and reconcile mail (the figures of the closing note)
    events: str = "off"
    event_faults: bool = False
    ticks: int = 0  # messages of the trickle (reconciled like the rest)
    truth_seconds: float = 0.0
    ambiguous_sends: int = 0  # unanswered attempts of hold and reconcile mail
    ambiguous_rows: int = 0  # rows with at least one
    ambiguous_reached: int = 0  # rows whose first ambiguous send SES took
    resolved_by_events: int = 0  # of those, sent by its events with that send's id
    events_lost_ambiguous: int = 0  # of those, hold mail whose events were dropped: left
    requeued: int = 0  # reconcile:requeued attempts
    requeued_delivered: int = 0  # requeued rows then received exactly once
    left_for_human: int = 0  # hold and reconcile mail still unknown_outcome
    reconcile_left: int = 0  # of those, reconcile mail: must be 0
    events_published: int = 0  # distinct events published (one published twice counts once)
    events_duplicated: int = 0  # published twice
    events_dropped: int = 0  # never published
    events_recorded: int = 0  # outbox_events rows
    event_effects: Counter[str] = field(default_factory=Counter)
    delivered_status: int = 0  # sent rows whose events made them 'delivered'
    dead_letters: int = 0  # messages on the dead-letter queue at the end: must be 0
    problems: list[str] = field(default_factory=list)

    @property
    def unknown_bound(self) -> int:
        return sum(self.in_flight_at_faults) + self.ambiguous_faults + self.slow_answers

    @property
    def cancel_confirmed(self) -> int:
        """Cancels the CLI reported as done."""
        return sum(1 for answer in self.cancels.values() if answer == "cancelled")

    @property
    def cancel_lost(self) -> int:
        """Cancels the CLI reported as not done: the row was claimed, sent or moved first."""
        return len(self.cancels) - self.cancel_confirmed

    def line(self) -> str:
        return (
            f"[{self.backend}] {self.scenario}: N={self.messages} K={self.relays} "
            f"in {self.runtime:.1f}s; delivered {self.delivered} (accepted {self.accepted}), "
            f"sent {self.sent}, duplicates {self.duplicates} (resend {self.resend_duplicates}), "
            f"lost {self.lost}, unknown {self.unknown} <= bound {self.unknown_bound} "
            f"(in flight at faults {self.in_flight_at_faults}, ambiguous SES faults "
            f"{self.ambiguous_faults}; read timeouts on passed requests {self.slow_answers}), "
            f"failed {self.failed}, expired {self.expired}, "
            f"cancelled {self.cancelled} (cancelled or expired resend mail that an "
            f"unanswered send had delivered: {self.ended_after_unanswered}); "
            f"stale finalizes recorded {self.stale_finalized} "
            f"(sent after the sweep {self.sent_after_sweep}); "
            f"relays restarted {self.restarts}; "
            f"database restarts {self.db_restarts} "
            f"({', '.join(f'{s:.1f}s' for s in self.restart_seconds) or 'none'}); "
            f"cancels {self.cancel_confirmed} done, {self.cancel_lost} lost the race; "
            f"lease_expired attempts {self.lease_expired}; "
            + self.scenario_line()
            + self.events_line()
            + (
                f"SES requests {dict(self.requests)} at {self.throughput:.0f}/s; "
                if self.sender == "ses"
                else f"fake sender: {self.accepted} sends at {self.throughput:.0f}/s; "
            )
            + f"problems {len(self.problems)}"
            + "".join(f"; NOTE {note}" for note in self.notes)
        )

    def events_line(self) -> str:
        """What the event intake and the reconcile sweeps did, with the events on."""
        if self.events == "off":
            return ""
        return (
            f"events {self.events}{' with event faults' if self.event_faults else ''}: "
            f"{self.events_published} published ({self.events_duplicated} twice, "
            f"{self.events_dropped} dropped), {self.events_recorded} recorded "
            f"{dict(self.event_effects)}, dead letters {self.dead_letters}; "
            f"ambiguous sends {self.ambiguous_sends} on {self.ambiguous_rows} rows: "
            f"reached SES {self.ambiguous_reached} (resolved by events "
            f"{self.resolved_by_events}, events lost {self.events_lost_ambiguous}), "
            f"requeued {self.requeued} (then delivered once {self.requeued_delivered}), "
            f"left for a human {self.left_for_human} (reconcile mail {self.reconcile_left}); "
            f"delivered status {self.delivered_status}; trickle {self.ticks} messages, "
            f"owed nothing {self.truth_seconds:.1f}s after the chaos; "
        )

    def scenario_line(self) -> str:
        """What the scenario's own checks counted."""
        if self.scenario == "db_outage" and self.outage is not None:
            return (
                f"database cut {self.outage[1] - self.outage[0]:.1f}s "
                f"({self.dropped_connections} connections dropped, "
                f"{self.refused_connections} refused), {len(self.outage_in_flight)} sends in "
                f"flight at the cut ({self.outage_in_flight_accepted} of them accepted by "
                f"SES), {self.accepted_during_outage} accepted while cut; accepted then "
                f"unknown or swept {self.accepted_unknown}; "
            )
        if self.scenario == "clock_skew":
            offsets = ", ".join(f"{m:+d} min: {n}" for m, n in sorted(self.signing_offsets.items()))
            return f"SES requests by signer's clock offset {{{offsets}}}; "
        if self.scenario == "tls_fault":
            return f"corrupt TLS answers {self.tls_faults} (to hold mail {self.tls_held}); "
        if self.scenario == "paused_set" and self.window is not None:
            return (
                f"{PAUSED_SET} paused {self.window[1] - self.window[0]:.1f}s: other mail "
                f"accepted meanwhile {self.window_other_sends}, {PAUSED_SET} mail "
                f"{len(self.marketing)} (accepted before the window {self.marketing_before}, "
                f"during {self.window_marketing_accepted}, after {self.marketing_after}; refused "
                f"{self.marketing_refused}); relay states seen {dict(self.relay_states)}; "
            )
        return ""


@dataclass(frozen=True, kw_only=True)
class RestartWindow:
    """One database restart: the last moment the harness read the database before it went down
    (wall clock), the sends in flight then, and when its connection was dropped."""

    last_read: float
    in_flight: frozenset[int]
    down: float  # when the harness's own connection was dropped


# -- setup -----------------------------------------------------------------------------------


def category_of(n: int, kinds: tuple[str, ...] = CATEGORIES) -> str:
    return kinds[n % len(kinds)]


def is_marketing(n: int) -> bool:
    """paused_set: every fifth message that does not expire (so all of it is delivered)."""
    return n % 5 == 0 and category_of(n) != "expiring"


def enqueue(
    engine: sa.Engine,
    count: int,
    *,
    expires_in: float,
    marketing: set[int] | None = None,
    kinds: tuple[str, ...] = CATEGORIES,
) -> dict[int, str]:
    """Enqueue ``count`` messages, an equal share per category of ``kinds``; returns
    {id: category}. With ``marketing`` (a set to fill with their ids) some are sent with the
    configuration set ``PAUSED_SET``."""
    Sessions, ids = sessionmaker(engine), {}
    expires_at = datetime.now(UTC) + timedelta(seconds=expires_in)
    for start in range(0, count, 500):
        with Sessions.begin() as session:
            for n in range(start, min(count, start + 500)):
                cat = category_of(n, kinds)
                chosen = marketing is not None and is_marketing(n)
                result = OUTBOX.enqueue(
                    session,
                    email(
                        n, subject=f"ledger {n}", configuration_set=PAUSED_SET if chosen else None
                    ),
                    key=f"ledger:{n}",
                    category=cat,
                    expires_at=expires_at if cat == "expiring" else None,
                )
                ids[result.id] = cat
                if chosen and marketing is not None:
                    marketing.add(result.id)
    return ids


def empty(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        tables = (attempts, messages, relays, events, suppressions, operator_actions, intakes)
        for table in tables:
            conn.execute(table.delete())


class Trickle:
    """New mail while the reconcile windows run out: one ``fast`` message every
    ``TICK_INTERVAL`` seconds on a thread of its own, as production traffic would keep coming.
    Its events are what proves the intake flows past each ambiguous attempt's window; without
    them the last ambiguous sends of a run would rightly never be requeued."""

    def __init__(self, engine: sa.Engine, interval: float = TICK_INTERVAL) -> None:
        self._Sessions = sessionmaker(engine)
        self.interval = interval
        self._stopping = threading.Event()
        self.ids: dict[int, str] = {}
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="ledger-trickle", daemon=True)

    def __enter__(self) -> Trickle:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._thread.join(30)

    def _run(self) -> None:
        n = 0
        while not self._stopping.wait(0 if n == 0 else self.interval):
            n += 1
            try:
                with self._Sessions.begin() as session:
                    result = OUTBOX.enqueue(
                        session,
                        email(1_000_000 + n, subject=f"ledger tick {n}"),
                        key=f"ledger:tick:{n}",
                        category="fast",
                    )
                self.ids[result.id] = "fast"
            except sa.exc.DBAPIError as exc:
                self.errors.append(f"tick {n}: {type(exc).__name__}: {exc}"[:300])


def poison(engine: sa.Engine, ids: list[int]) -> None:
    """Edit payloads by hand into something no sender can build an email from."""
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages).where(messages.c.id.in_(ids)).values(payload={"not": "an email"})
        )


# -- relay processes ---------------------------------------------------------------------------


@dataclass
class Fleet:
    url: str
    endpoint: str
    workdir: Path
    args: tuple[str, ...]
    record: Path | None = None  # with the fake sender: its shared record of sends
    ca_bundle: Path | None = None  # the fault server's certificate, when it speaks TLS
    events: str = "off"  # one of EVENT_MODES
    queue: EventQueue | None = None  # the SES event queue (on moto), with the events on
    started: list[RelayProc] = field(default_factory=list)
    signalled: set[str] = field(default_factory=set)  # relay ids the harness killed or stopped
    intakes: list[RelayProc] = field(default_factory=list)  # outbox-relay events processes

    def signal(self, proc: RelayProc, signum: int) -> None:
        if signum in (signal.SIGKILL, signal.SIGTERM):
            self.signalled.add(proc.relay_id)
        proc.popen.send_signal(signum)

    def start(self, clock_offset: str | None = None) -> RelayProc:
        """Start one more relay; with ``clock_offset`` (libfaketime's ``+120s``) its wall
        clock runs that far off."""
        relay_id = f"ledger-{len(self.started) + 1}"
        log = self.workdir / f"{relay_id}.log"
        env = self.env()
        sender = "ses"
        if self.record is not None:
            env.update(OUTBOX_FAKE_RECORD_FILE=str(self.record), OUTBOX_FAKE_LATENCY="0")
            sender = FAKE_SENDER
        if clock_offset is not None:
            env = shifted(env, clock_offset)
        args = self.args
        if self.events == "run" and self.queue is not None:
            args = (*args, "--events-queue-url", self.queue.url, "--events-wait-seconds", "2")
        proc = spawn(self.url, sender, relay_id, log, env, *args)
        self.started.append(proc)
        return proc

    def env(self) -> dict[str, str]:
        """A relay's environment: SES is the fault server, SQS and SNS moto itself (the
        intake's calls are not the fault server's to break or count)."""
        env = {k: v for k, v in clean_env().items() if not k.startswith("AWS_")}
        events_url = self.queue.endpoint_url if self.queue is not None else None
        env.update(aws_env(self.endpoint, events_url=events_url))
        if self.ca_bundle is not None:
            env["AWS_CA_BUNDLE"] = str(self.ca_bundle)
        return env

    def start_intake(self) -> RelayProc:
        """Start one ``outbox-relay events`` process on the event queue (``--events process``):
        the intake on its own, beside relays that only send."""
        if self.queue is None:
            raise ValueError("an events process needs the event queue")
        name = f"ledger-events-{len(self.intakes) + 1}"
        log = self.workdir / f"{name}.log"
        command = [RELAY, "events", "--database-url", self.url]
        command += ["--events-queue-url", self.queue.url, "--wait-seconds", "2"]
        command += ["--log-level", "WARNING"]
        with log.open("wb") as out:
            popen = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(),
            )
        proc = RelayProc(popen, name, log)
        self.intakes.append(proc)
        return proc

    def running(self) -> list[RelayProc]:
        return [p for p in self.started if p.popen.poll() is None]

    def stop_all(
        self,
        summary: Summary,
        engine: sa.Engine,
        timeout: float = SEND_TIMEOUT + 1 + 2 * READ_TIMEOUT,
    ) -> None:
        """SIGTERM every running relay once each has registered: a relay signalled while
        Python is still importing has no handler yet and dies of the signal (it holds nothing
        then, but a drain is what this checks). Each must exit within its drain (the relays'
        ``--drain-seconds``) and two database read timeouts: a statement under way when the
        signal came and the one that deregisters it, each on a connection that may have gone
        silent in a fault."""

        def all_registered() -> bool:
            with engine.connect() as conn:
                ids = set(conn.execute(sa.select(relays.c.relay_id)).scalars())
            return all(p.relay_id in ids for p in self.running())

        wait_for(
            all_registered, interval=POLL, timeout=timeout, what="every running relay registered"
        )
        for proc in self.started:  # a relay must outlive every fault but a signal
            code = proc.popen.poll()
            if code is not None and proc.relay_id not in self.signalled:
                summary.problems.append(
                    f"{proc.relay_id} exited {code} by itself: {proc.output()[-1500:]}"
                )
        for proc in self.intakes:
            code = proc.popen.poll()
            if code is not None:
                summary.problems.append(
                    f"{proc.relay_id} exited {code} by itself: {proc.output()[-1500:]}"
                )
        running = self.running()
        # the relays first: an intake of its own keeps reading the queue until they are done
        for group in (running, [p for p in self.intakes if p.popen.poll() is None]):
            for proc in group:
                proc.popen.send_signal(signal.SIGCONT)
                proc.popen.send_signal(signal.SIGTERM)
            for proc in group:
                code = proc.wait(timeout)
                if code != 0:
                    summary.problems.append(
                        f"{proc.relay_id} exited {code} on SIGTERM: {proc.output()[-1500:]}"
                    )

    def kill_all(self) -> None:
        for proc in [*self.started, *self.intakes]:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGKILL)
                proc.popen.wait(10)


def registered(engine: sa.Engine, fleet: Fleet) -> list[RelayProc]:
    """Running relays that registered (their signal handlers are installed by then)."""

    def ready() -> list[RelayProc]:
        with engine.connect() as conn:
            ids = set(conn.execute(sa.select(relays.c.relay_id)).scalars())
        return [p for p in fleet.running() if p.relay_id in ids]

    return wait_for(ready, interval=POLL, timeout=30, what="a registered relay")


def in_flight(engine: sa.Engine, relay_id: str | None = None) -> int:
    """Processing rows whose send has started (of one relay, or of all)."""
    query = sa.select(sa.func.count()).where(
        messages.c.status == "processing", messages.c.send_started_at.is_not(None)
    )
    if relay_id is not None:
        query = query.where(messages.c.claimed_by == relay_id)
    with engine.connect() as conn:
        return conn.execute(query).scalar_one()


def claims_of(engine: sa.Engine, relay_id: str) -> dict[int, str]:
    """{id: claim token} of one relay's rows with a send in flight."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(messages.c.id, messages.c.claim_token).where(
                messages.c.status == "processing",
                messages.c.send_started_at.is_not(None),
                messages.c.claimed_by == relay_id,
            )
        )
        return {id_: token for id_, token in rows}


def progress(engine: sa.Engine, total: int) -> float:
    counts = statuses(engine)
    return sum(n for s, n in counts.items() if s in SETTLED) / max(total, 1)


# -- the faults --------------------------------------------------------------------------------


def kill_db_connections(engine: sa.Engine) -> int:
    """Kill every other connection to this database (the relays'): PostgreSQL
    ``pg_terminate_backend``, MariaDB ``KILL``. Only this test's own database is touched."""
    engine.dispose()  # the harness's pooled connections are not the target
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            killed = conn.execute(
                sa.text(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) "
                    "FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
        else:
            ids = conn.execute(
                sa.text(
                    "SELECT id FROM information_schema.processlist "
                    "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
                )
            ).scalars()
            killed = 0
            for id_ in list(ids):
                try:
                    conn.execute(sa.text(f"KILL {int(id_)}"))
                    killed += 1
                except sa.exc.DBAPIError:  # it ended by itself meanwhile
                    pass
        conn.commit()
    return int(killed)


class DatabaseProxy:
    """A TCP proxy on 127.0.0.1 (a free port) in front of the database server, for the relays
    only (:meth:`url` is their ``--database-url``). :meth:`cut` drops every proxied connection
    (reset on both sides) and refuses new ones (accepted, then reset) until :meth:`restore`:
    an outage of the database as the relays see it, while the server itself runs on."""

    def __init__(self, url: str) -> None:
        target = sa.make_url(url)
        default = 5432 if target.get_backend_name() == "postgresql" else 3306
        self._upstream = (target.host or "127.0.0.1", target.port or default)
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._refusing = False
        self._stopping = threading.Event()
        self.dropped = 0
        self.refused = 0
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._accept, name="db-proxy", daemon=True)

    @property
    def url(self) -> str:
        return self._target.set(host="127.0.0.1", port=self.port).render_as_string(
            hide_password=False
        )

    def __enter__(self) -> DatabaseProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._thread.join(10)
        self._listener.close()
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            self._close(pair, reset=True)

    def cut(self) -> int:
        """Drop every proxied connection and refuse new ones; returns how many it dropped."""
        with self._lock:
            self._refusing = True
            pairs = list(self._pairs)
        for pair in pairs:
            self._close(pair, reset=True)
        self.dropped += len(pairs)
        return len(pairs)

    def restore(self) -> None:
        with self._lock:
            self._refusing = False

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # one failed accept ends nothing but that connection
                if self._stopping.is_set():
                    return
                self.errors.append(f"accept: {exc}")
                continue
            with self._lock:
                refusing = self._refusing
            if refusing:
                self.refused += 1
                _reset(client)
                continue
            try:
                server = socket.create_connection(self._upstream, timeout=10)
            except OSError as exc:
                self.errors.append(f"connect to {self._upstream}: {exc}")
                _reset(client)
                continue
            server.settimeout(None)
            pair = (client, server)
            with self._lock:
                refusing = self._refusing  # a cut while connecting upstream drops this one too
                if not refusing:
                    self._pairs.add(pair)
            if refusing:
                self.refused += 1
                _reset(client)
                _reset(server)
                continue
            for src, dst in (pair, pair[::-1]):
                threading.Thread(
                    target=self._pump, args=(src, dst, pair), name="db-proxy-pump", daemon=True
                ).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, socket.socket]
    ) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        self._close(pair, reset=False)

    def _close(self, pair: tuple[socket.socket, socket.socket], *, reset: bool) -> None:
        """Close both sides once (the first caller wins): with an RST when ``reset``, else as
        the side that ended did (its peer sees the end of the stream)."""
        with self._lock:
            if pair not in self._pairs:
                return
            self._pairs.discard(pair)
        for sock in pair:
            if reset:
                _reset(sock)
            else:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER on, zero timeout), waking a thread blocked reading it."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def server_started_at(engine: sa.Engine) -> float:
    """When the database server last started (epoch seconds, to about a second on MariaDB)."""
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            return float(
                conn.execute(
                    sa.text("SELECT extract(epoch FROM pg_postmaster_start_time())")
                ).scalar_one()
            )
        uptime = conn.execute(
            sa.text(
                "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS "
                "WHERE VARIABLE_NAME = 'UPTIME'"
            )
        ).scalar_one()
        return time.time() - float(uptime)


def in_flight_ids(conn: sa.Connection) -> frozenset[int]:
    return frozenset(
        conn.execute(
            sa.select(messages.c.id).where(
                messages.c.status == "processing", messages.c.send_started_at.is_not(None)
            )
        ).scalars()
    )


def restart_database(engine: sa.Engine, command: str, summary: Summary, workdir: Path) -> None:
    """Run ``command`` (a real stop and start of the server) while the relays run. Meanwhile
    read the sends in flight on a connection of its own until the server drops it; then wait
    until the server accepts connections again. The harness's pooled connections are gone with
    the server: dispose of them."""
    before = server_started_at(engine)
    log = workdir / f"restart-{summary.db_restarts + len(summary.restart_seconds) + 1}.log"
    watcher = make_engine(engine.url, poolclass=sa.pool.NullPool)
    began = time.monotonic()
    try:
        conn = watcher.connect()
        last_read, flying = time.time(), in_flight_ids(conn)
        down = float("inf")
        with log.open("wb") as out:
            restart = subprocess.Popen(
                command, shell=True, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
            try:
                while True:
                    at = time.time()
                    try:
                        ids = in_flight_ids(conn)
                        conn.rollback()
                    except sa.exc.DBAPIError:
                        down = time.time()  # the server went down
                        break
                    last_read, flying = at, ids
                    if restart.poll() is not None:
                        break  # done, and the connection still works: it did not restart
                    time.sleep(0.01)
                code = restart.wait(RESTART_TIMEOUT)
            except subprocess.TimeoutExpired:
                restart.kill()
                raise AssertionError(
                    f"restart command still running after {RESTART_TIMEOUT}s: {command}"
                ) from None
        conn.invalidate()
        conn.close()
        if code != 0:
            raise AssertionError(
                f"restart command exited {code}: {command}\n{log.read_text()[-2000:]}"
            )

        def accepting() -> bool:
            try:
                with watcher.connect() as probe:
                    probe.execute(sa.text("SELECT 1"))
            except sa.exc.DBAPIError:
                return False
            return True

        wait_for(
            accepting,
            interval=POLL,
            timeout=RESTART_TIMEOUT,
            what="the database to accept connections",
        )
    finally:
        watcher.dispose()
    engine.dispose()
    summary.restart_seconds.append(time.monotonic() - began)
    after = server_started_at(engine)
    if after <= before + 0.5:
        summary.problems.append(f"the server did not restart: {command!r} left it running")
        return
    if down == float("inf"):
        summary.problems.append("the server restarted, but the harness never saw it go down")
        return
    summary.db_restarts += 1
    summary.restart_windows.append(RestartWindow(last_read=last_read, in_flight=flying, down=down))


def cancel_sample(
    engine: sa.Engine, url: str, summary: Summary, rng: random.Random, workdir: Path
) -> None:
    """Cancel a sample of messages through the real CLI while the relays run, one
    ``outbox-relay cancel ID --yes`` per message, a few at once: pending rows from the head of
    the queue (the next to be claimed: some lose the race), pending rows from its tail (these
    should be cancelled), and rows already claimed or sent (refused). Records what the CLI said."""
    order = (messages.c.priority, messages.c.next_attempt_at, messages.c.id)
    with engine.connect() as conn:
        queued = list(
            conn.execute(
                sa.select(messages.c.id)
                .where(messages.c.status.in_(("pending", "retrying")))
                .order_by(*order)
            ).scalars()
        )
        taken = list(
            conn.execute(
                sa.select(messages.c.id)
                .where(messages.c.status.in_(("processing", "sent")))
                .order_by(messages.c.updated_at.desc())
                .limit(20)
            ).scalars()
        )
    queued = [i for i in queued if i not in summary.cancels]
    taken = [i for i in taken if i not in summary.cancels]
    # a CLI takes a second or more to start on a busy machine: the tail is the very end
    head, tail = queued[:6], queued[-10:]
    picks = [
        *rng.sample(tail, min(3, len(tail))),
        *rng.sample(head, min(2, len(head))),
        *rng.sample(taken, min(2, len(taken))),
    ]
    env = clean_env()

    def cancel(id_: int) -> tuple[int, str]:
        done = subprocess.run(
            [RELAY, "cancel", "--database-url", url, str(id_), "--yes", "--reason", "ledger"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        said = (done.stdout + done.stderr).strip()
        if done.returncode == 0 and said == "cancelled 1 message(s)":
            return id_, "cancelled"
        if done.returncode == 0 and said.startswith("cancelled 0 message(s) (1 moved meanwhile"):
            return id_, "moved"
        if done.returncode == 1 and f"cannot cancel {id_} (" in said:
            return id_, "refused: " + said.split(f"cannot cancel {id_} (", 1)[1].split(")")[0]
        return id_, f"unexpected (exit {done.returncode}): {said[-500:]}"

    if not picks:
        return
    with ThreadPoolExecutor(len(picks)) as pool:
        for id_, answer in pool.map(cancel, picks):
            summary.cancels[id_] = answer
            if answer.startswith("unexpected"):
                summary.problems.append(f"outbox-relay cancel {id_}: {answer}")
    (workdir / "cancels.log").write_text(
        "".join(f"{i}\t{a}\n" for i, a in sorted(summary.cancels.items()))
    )


def sigkill(engine: sa.Engine, fleet: Fleet, summary: Summary, rng: random.Random) -> None:
    victim = rng.choice(registered(engine, fleet))
    fleet.signal(victim, signal.SIGKILL)
    victim.popen.wait(10)
    # dead: its rows cannot move until their lease runs out (LEASE s), so this is exact
    summary.in_flight_at_faults.append(in_flight(engine, victim.relay_id))
    fleet.start()
    summary.restarts += 1


def sigterm(engine: sa.Engine, fleet: Fleet, summary: Summary, rng: random.Random) -> None:
    victim = rng.choice(registered(engine, fleet))
    summary.in_flight_at_faults.append(in_flight(engine, victim.relay_id))
    fleet.signal(victim, signal.SIGTERM)
    fleet.start()  # the replacement starts while the old one drains, as in a deploy
    summary.restarts += 1
    code = victim.wait(30)
    if code != 0:
        summary.problems.append(f"{victim.relay_id} exited {code} on SIGTERM")


@dataclass(frozen=True)
class Faults:
    """What a fault schedule acts on."""

    engine: sa.Engine
    url: str
    fleet: Fleet
    ses: FaultServer
    summary: Summary
    rng: random.Random
    total: int
    workdir: Path
    restart_command: str | None
    proxy: DatabaseProxy | None = None  # db_outage: between the relays and the database

    def at(self, mark: float) -> None:
        """Wait until ``mark`` (a share) of the rows have settled."""
        wait_for(
            lambda: progress(self.engine, self.total) >= mark,
            interval=POLL,
            timeout=120,
            what=f"{mark:.0%} of rows settled",
        )


def database_outage(f: Faults) -> None:
    """While sends are in flight, cut the relays off the database (every proxied connection
    dropped, new ones refused) for ``OUTAGE_SECONDS``, longer than the lease, then let them
    back. What the cut froze is read on the harness's own connection, which the cut leaves
    alone: the sends in flight (started, not finalized) once the server has finished what it
    had (a commit sent just before the cut), and that nothing moves until the end."""
    if f.proxy is None:
        raise ValueError("the db_outage scenario needs the relays behind a DatabaseProxy")
    wait_for(lambda: in_flight(f.engine) > 0, interval=POLL, timeout=30, what="a send in flight")
    began = time.monotonic()
    f.summary.dropped_connections += f.proxy.cut()
    time.sleep(0.5)
    frozen, counts = in_flight_ids_of(f.engine), statuses(f.engine)
    f.summary.in_flight_at_faults.append(len(frozen))
    f.summary.outage_in_flight = frozen
    time.sleep(max(0.0, began + OUTAGE_SECONDS - time.monotonic()))
    if (in_flight_ids_of(f.engine), statuses(f.engine)) != (frozen, counts):
        f.summary.problems.append("rows moved while the relays were cut off the database")
    f.proxy.restore()
    f.summary.outage = (began, time.monotonic())
    f.summary.refused_connections = f.proxy.refused


def in_flight_ids_of(engine: sa.Engine) -> frozenset[int]:
    with engine.connect() as conn:
        return in_flight_ids(conn)


def relay_states(engine: sa.Engine) -> Counter[str]:
    with engine.connect() as conn:
        return Counter(conn.execute(sa.select(relays.c.state)).scalars())


def pause_configuration_set(f: Faults) -> None:
    """Early in the run, while most marketing mail is still queued, SES pauses the
    configuration set ``PAUSED_SET`` for ``PAUSED_SET_WINDOW`` seconds. Meanwhile, and for a
    second after, the relays' states are sampled from ``outbox_relays``."""
    f.at(0.1)
    began = time.monotonic()
    f.ses.plan.paused_sets.add(PAUSED_SET)
    try:
        while time.monotonic() < began + PAUSED_SET_WINDOW:
            f.summary.relay_states.update(relay_states(f.engine))
            time.sleep(0.1)
    finally:
        f.ses.plan.paused_sets.discard(PAUSED_SET)
    f.summary.window = (began, time.monotonic())
    for _ in range(10):  # a relay's state shows at its next heartbeat at the latest
        f.summary.relay_states.update(relay_states(f.engine))
        time.sleep(0.1)


def combined(f: Faults) -> None:
    """Every fault in one run: the SES fault mix throughout, and in turn operator cancels, a
    SIGKILL, killed database connections, a SIGTERM drain, a database restart (when a restart
    command is configured), a pause window, more cancels and another SIGKILL."""
    f.ses.plan.set(**SES_FAULT_MIX)
    f.at(0.05)
    cancel_sample(f.engine, f.url, f.summary, f.rng, f.workdir)
    f.at(0.15)
    sigkill(f.engine, f.fleet, f.summary, f.rng)
    f.at(0.25)
    f.summary.in_flight_at_faults.append(in_flight(f.engine))
    kill_db_connections(f.engine)
    f.at(0.35)
    sigterm(f.engine, f.fleet, f.summary, f.rng)
    f.at(0.45)
    if f.restart_command:
        restart_database(f.engine, f.restart_command, f.summary, f.workdir)
    else:
        f.summary.notes.append("no database restart: no restart command configured")
    f.at(0.55)
    f.ses.plan.paused = True
    time.sleep(PAUSE_WINDOW)
    f.ses.plan.paused = False
    f.at(0.6)
    cancel_sample(f.engine, f.url, f.summary, f.rng, f.workdir)
    f.at(0.7)
    sigkill(f.engine, f.fleet, f.summary, f.rng)


def inject(f: Faults, scenario: str) -> None:
    """The scenario's fault schedule, spread over the first ~80% of the run."""
    engine, fleet, ses, summary, rng = f.engine, f.fleet, f.ses, f.summary, f.rng
    marks = sorted(rng.uniform(0.05, 0.7) for _ in range(rng.randint(3, 5)))
    if scenario == "combined":
        combined(f)
        return
    if scenario == "db_outage":
        f.at(0.3)
        database_outage(f)
        return
    if scenario == "tls_fault":
        ses.plan.set(**TLS_FAULT_MIX)
        return
    if scenario == "paused_set":
        pause_configuration_set(f)
        return
    if scenario == "clock_skew":
        return  # the skewed clocks are the fault: the relays started with them
    if scenario == "reconcile":
        f.at(0.05)
        ses.plan.set(**RECONCILE_FAULT_MIX)
        time.sleep(FAULT_BURST)
        ses.plan.set()
        f.at(0.5)
        sigkill(engine, fleet, summary, rng)
        return
    if scenario == "ses_faults":
        ses.plan.set(**SES_FAULT_MIX)
        f.at(0.3)
        ses.plan.paused = True
        time.sleep(PAUSE_WINDOW)
        ses.plan.paused = False
        return
    if scenario == "db_restart":
        if not f.restart_command:
            raise ValueError("the db_restart scenario needs a restart command")
        for mark in (0.15, 0.4, 0.65):
            f.at(mark)
            restart_database(engine, f.restart_command, summary, f.workdir)
        return
    if scenario == "cancel":
        for mark in (0.05, 0.3):
            f.at(mark)
            cancel_sample(engine, f.url, summary, rng, f.workdir)
        return
    if scenario == "slow_sender":
        marks = marks[:1]
    for mark in marks:
        f.at(mark)
        if scenario == "db_kill":
            summary.in_flight_at_faults.append(in_flight(engine))
            kill_db_connections(engine)
            continue
        if scenario == "sigkill":
            sigkill(engine, fleet, summary, rng)
        elif scenario == "sigterm":
            sigterm(engine, fleet, summary, rng)
        elif scenario == "slow_sender":
            victim = rng.choice(registered(engine, fleet))
            # stop it while it has a send in flight, hold it past its lease, let others sweep
            deadline = time.monotonic() + 30
            while True:
                victim.popen.send_signal(signal.SIGSTOP)
                frozen = in_flight(engine, victim.relay_id)
                if frozen or time.monotonic() > deadline:
                    break
                victim.popen.send_signal(signal.SIGCONT)
                time.sleep(rng.uniform(0.01, 0.05))
            summary.in_flight_at_faults.append(frozen)
            summary.frozen_claims = claims_of(engine, victim.relay_id)
            time.sleep(LEASE + 2.0)
            wait_for(
                lambda v=victim: in_flight(engine, v.relay_id) == 0,
                interval=POLL,
                timeout=30,
                what="the stopped relay's rows to be swept",
            )
            victim.popen.send_signal(signal.SIGCONT)
        else:  # clean, poison, xmin: no fault during the run
            return


class LossyEvents(FaultServer):
    """The fault server losing every event of a share of the sends it answered (``pass``), of
    mail that is not ``reconcile`` (``--event-faults``; why not reconcile mail: see the module
    docstring). :attr:`lost` holds moto's MessageIds of those sends."""

    def __init__(self, *args: Any, share: float, seed: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loss = random.Random(f"lost-events-{seed}")
        self.share = share
        self.lost: set[str] = set()

    def _publish_events(self, send: SendRequest) -> None:
        if (
            send.kind == "pass"
            and send.category != "reconcile"
            and send.message_id is not None
            and self._loss.random() < self.share
        ):
            self.lost.add(send.message_id)
            return
        super()._publish_events(send)


def lost_events(ses: FaultServer) -> frozenset[str]:
    """moto's MessageIds of the sends whose events were never published."""
    return frozenset(ses.lost) if isinstance(ses, LossyEvents) else frozenset()


OPEN = ("unknown_outcome", "pending", "retrying", "processing")  # what the events may still move


def owed(
    engine: sa.Engine, ses: FaultServer, queue: EventQueue, *, drained: bool = True
) -> str | None:
    """What the intake and the reconcile sweeps still owe, or None: reconcile mail not yet
    settled for good, rows SES took (and whose events were published) still open, and, with
    ``drained``, events not yet published or messages still on the queue (while mail keeps
    coming there always are some)."""
    lost = lost_events(ses)
    took = {s.outbox_id for s in ses.sends if s.accepted and s.message_id not in lost}
    with engine.connect() as conn:
        rows = dict(
            conn.execute(
                sa.select(messages.c.id, messages.c.category).where(messages.c.status.in_(OPEN))
            ).all()
        )
    parts = []
    if mail := sorted(i for i, c in rows.items() if c == "reconcile"):
        parts.append(f"reconcile mail open {mail[:10]}")
    if taken := sorted(i for i in rows if i in took):
        parts.append(f"rows SES took still open {taken[:10]}")
    if not drained:
        return "; ".join(parts) or None
    if ses.events is not None:
        try:
            ses.events.flush(0.01)
        except TimeoutError:
            parts.append("events not yet published")
    counts = queue.counts()
    if counts["visible"] or counts["in_flight"]:
        parts.append(f"queue {counts}")
    return "; ".join(parts) or None


def await_truth(
    engine: sa.Engine,
    ses: FaultServer,
    queue: EventQueue,
    categories: dict[int, str],
    summary: Summary,
    total: int,
    tick_interval: float = TICK_INTERVAL,
) -> None:
    """After the chaos: the faults end, the trickle runs, and the harness waits until the
    intake and the reconcile sweeps owe nothing (:func:`owed`), then for the trickle's own mail
    and events. Past ``TRUTH_TIMEOUT`` it records what is still owed; the reconciliation names
    the rows."""
    ses.plan.set()
    ses.plan.paused = False
    began = time.monotonic()

    def settle(deadline: float, *, drained: bool = True) -> str | None:
        while (left := owed(engine, ses, queue, drained=drained)) and time.monotonic() < deadline:
            time.sleep(POLL * 4)
        return left

    with Trickle(engine, tick_interval) as trickle:
        left = settle(began + TRUTH_TIMEOUT, drained=False)
    categories.update(trickle.ids)
    summary.ticks = len(trickle.ids)
    summary.problems.extend(trickle.errors)
    wait_for(
        lambda: progress(engine, total + summary.ticks) >= 1.0,
        interval=POLL,
        timeout=30,
        what=f"the trickle's mail settled ({dict(statuses(engine))})",
    )
    left = left or settle(time.monotonic() + 30)
    summary.truth_seconds = time.monotonic() - began
    if left is not None:
        summary.problems.append(
            f"{summary.truth_seconds:.0f}s after the chaos the intake and the reconcile "
            f"sweeps still owe: {left}"
        )


def warm_up(moto: MotoSes) -> None:
    """One send straight to moto (not through the fault server, so not in the ledger): moto
    loads its SES backend on the first request, which can outlast the relays' read timeout
    and would make an ambiguous send no fault of ours caused."""
    moto.client().send_email(
        FromEmailAddress="shop@example.com",
        Destination={"ToAddresses": ["warm-up@example.com"]},
        Content={"Simple": {"Subject": {"Data": "warm-up"}, "Body": {"Text": {"Data": "."}}}},
    )


def hold_xmin(engine: sa.Engine) -> sa.Connection:
    """A REPEATABLE READ transaction that read a row and stays open: on PostgreSQL it holds the
    xmin horizon back, so no dead tuple made after it can be vacuumed while it lives."""
    if engine.dialect.name != "postgresql":
        raise ValueError("the xmin scenario is PostgreSQL only")
    conn = engine.connect().execution_options(isolation_level="REPEATABLE READ")
    conn.begin()
    conn.execute(sa.select(messages.c.id).limit(1)).all()
    return conn


# -- reconciliation ----------------------------------------------------------------------------


def fake_sends(record: Path) -> list[SendRequest]:
    """The fake sender's record as SES requests: every send accepted, under the provider id
    ``fake-ID-ATTEMPT`` the sender answers (the attempt number is not recorded: ``*``)."""
    return [
        SendRequest(
            at=0.0,
            wall=0.0,
            kind="pass",
            outbox_id=id_,
            category=None,
            recipients=1,
            subject=None,
            request={},
            status=200,
            message_id=f"fake-{id_}-*",
        )
        for id_, times in sorted(read_deliveries(record).items())
        for _ in range(times)
    ]


def send_rate(tries: dict[int, list[Any]]) -> float:
    """Provider calls per second, from the first call's start to the last one's end, as the
    relays recorded them in ``outbox_attempts`` (the same measure for any sender)."""
    calls = [a for mine in tries.values() for a in mine if a.started_at is not None]
    if len(calls) < 2:
        return 0.0
    first = min(a.started_at for a in calls)
    last = max(a.finished_at for a in calls)
    return len(calls) / max((last - first).total_seconds(), 1e-6)


def reconcile(
    engine: sa.Engine,
    ses: FaultServer,
    categories: dict[int, str],
    summary: Summary,
    poisoned: set[int],
    record: Path | None = None,
    queue: EventQueue | None = None,
) -> None:
    sends = ses.sends if record is None else fake_sends(record)
    accepted = Counter(s.outbox_id for s in sends if s.accepted and s.outbox_id is not None)
    provider_ids: defaultdict[int, set[str | None]] = defaultdict(set)
    for s in sends:
        if s.accepted and s.outbox_id is not None:
            provider_ids[s.outbox_id].add(s.message_id)
    summary.requests = Counter(s.kind for s in sends)
    if len(sends) > 1:
        summary.throughput = (len(sends) - 1) / max(sends[-1].at - sends[0].at, 1e-6)
    summary.ambiguous_faults = sum(1 for s in sends if s.kind in UNHEARD_KINDS)
    summary.delivered = len(accepted)
    summary.accepted = sum(accepted.values())
    # a relay killed (or a connection reset) mid-answer breaks the server's write: benign, the
    # request is in the ledger already; anything else means the ledger cannot be trusted
    errors = [e for e in ses.errors if not any(b in e for b in BENIGN_ERRORS)]
    if errors:
        summary.problems.append(f"fault server errors: {errors[:3]}")
    unknown_ids = set(accepted) - set(categories)
    if unknown_ids:
        summary.problems.append(f"SES accepted ids that are not rows: {sorted(unknown_ids)[:5]}")

    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(sa.select(messages))}
        tries: defaultdict[int, list[Any]] = defaultdict(list)
        for a in conn.execute(sa.select(attempts).order_by(attempts.c.id)):
            tries[a.message_id].append(a)
    if record is not None:
        summary.throughput = send_rate(tries)

    def problem(id_: int, what: str) -> None:
        row = rows[id_]
        summary.problems.append(
            f"#{id_} ({categories[id_]}) {row.status}: {what}; received {accepted[id_]}, "
            f"requests {[s.kind for s in sends if s.outbox_id == id_]}"
        )

    for id_, row in rows.items():
        got, resend = accepted[id_], categories[id_] == "digest"
        if got > 1:
            if resend:
                summary.resend_duplicates += got - 1
            else:
                summary.duplicates += got - 1
                problem(id_, "delivered more than once under hold")
        if id_ in poisoned and (row.status, row.last_error_code) != ("failed", "invalid_payload"):
            problem(id_, f"poisoned row ended {row.status}/{row.last_error_code}")
        match row.status:
            case "sent":
                summary.sent += 1
                if got == 0:
                    summary.lost += 1
                    problem(id_, "marked sent, SES never accepted it")
                elif row.provider_message_id not in provider_ids[id_] and not (
                    record is not None and str(row.provider_message_id).startswith(f"fake-{id_}-")
                ):
                    problem(id_, f"provider id {row.provider_message_id} is not SES's")
            case "unknown_outcome":
                summary.unknown += 1
                if resend:
                    problem(id_, "resend mail parked as unknown_outcome")
                # the attempt that parked it, under the claim that made the send (a stale
                # finalize of the same claim may be recorded after it)
                parking = [
                    a
                    for a in tries[id_]
                    if a.outcome in ("ambiguous", "lease_expired")
                    and a.claim_token is not None
                    and a.relay_id == row.claimed_by
                    and a.started_at == row.send_started_at
                ]
                if not parking:
                    problem(id_, f"no attempt under the claim that made it: {tries[id_]}")
            case "failed":
                summary.failed += 1
                if got:
                    problem(id_, "failed but SES accepted it")
                if not row.last_error_code:
                    problem(id_, "failed with no error code")
            case "cancelled" | "expired":
                if row.status == "cancelled":
                    summary.cancelled += 1
                else:
                    summary.expired += 1
                # resend mail goes back to retrying after an ambiguous send, and a retrying row
                # can be cancelled or expire: each unanswered send may have been delivered
                unanswered = [a for a in tries[id_] if a.outcome in UNANSWERED]
                if got and resend and got <= len(unanswered):
                    summary.ended_after_unanswered += 1
                elif got:
                    problem(id_, f"{row.status} but SES accepted it")
            case _:
                summary.lost += 1
                problem(id_, "never settled")
    for id_, token in summary.frozen_claims.items():
        mine = [a for a in tries[id_] if a.claim_token == token]
        outcomes = [a.outcome for a in mine]
        # swept by another relay (lease_expired), then the stopped relay's own finalize, stale,
        # recorded under the same claim all the same
        if "lease_expired" not in outcomes:
            problem(id_, f"the frozen claim was never swept: {outcomes}")
        else:
            # did the stopped relay's request reach SES only after another relay swept it?
            swept_at = next(a for a in mine if a.outcome == "lease_expired").finished_at
            stale_call = next((a for a in mine if a.outcome != "lease_expired"), None)
            if stale_call is not None and stale_call.provider_message_id is not None:
                arrival = next(
                    (s.wall for s in sends if s.message_id == stale_call.provider_message_id),
                    None,
                )
                if arrival is not None and arrival > swept_at.timestamp():
                    summary.sent_after_sweep += 1
        if not any(o != "lease_expired" for o in outcomes):
            problem(id_, f"the stale finalize left no attempt: {outcomes}")
        else:
            summary.stale_finalized += 1
    reconcile_cancels(rows, tries, summary, problem)
    reconcile_restarts(tries, summary)
    summary.lease_expired = sum(
        1 for mine in tries.values() for a in mine if a.outcome == "lease_expired"
    )
    summary.signing_offsets = Counter(
        round((s.signed_at - s.wall) / 60) for s in sends if s.signed_at is not None
    )
    reconcile_tls(rows, tries, sends, summary, problem)
    reconcile_outage(rows, tries, sends, accepted, summary, problem)
    reconcile_pause_window(rows, sends, accepted, summary, problem)
    if summary.events != "off":
        reconcile_events(engine, ses, queue, rows, tries, accepted, categories, summary, problem)
    faulted = {s.outbox_id for s in sends if s.kind in AMBIGUOUS_KINDS}
    # SES's own unanswered requests: moto took the message (the fault server saw it accepted)
    # and answered after the relay's read timeout (a loaded machine): ambiguous by definition
    summary.slow_answers = sum(
        1
        for id_, mine in tries.items()
        for a in mine
        if a.outcome == "ambiguous"
        and a.error_code == "ReadTimeoutError"
        and id_ not in faulted
        and accepted[id_] > 0
    )
    if summary.unknown > summary.unknown_bound:
        summary.problems.append(
            f"{summary.unknown} unknown_outcome rows, but only {summary.unknown_bound} sends "
            "were ambiguous (in flight at a fault, a hang/reset, or accepted by SES and "
            "answered after the read timeout)"
        )


def reconcile_cancels(
    rows: dict[int, Any],
    tries: dict[int, list[Any]],
    summary: Summary,
    problem: Callable[[int, str], None],
) -> None:
    """What the CLI reported is what happened: a reported cancel is a ``cancelled`` row (never
    received, checked with every cancelled row) with the operator's attempt; a refused or moved
    one is not cancelled and has no such attempt; nothing else cancels a row."""
    for id_, answer in summary.cancels.items():
        row = rows[id_]
        recorded = [a for a in tries[id_] if a.outcome == "cancelled"]
        if answer == "cancelled":
            if row.status != "cancelled":
                problem(id_, "the CLI reported it cancelled")
            if not recorded or not recorded[0].relay_id.startswith("operator"):
                problem(id_, f"cancelled with no operator attempt: {tries[id_]}")
        elif answer.startswith(("refused", "moved")) and (row.status == "cancelled" or recorded):
            problem(id_, f"cancelled, but the CLI reported it {answer}")
    for id_, row in rows.items():
        if row.status == "cancelled" and summary.cancels.get(id_) != "cancelled":
            problem(id_, f"cancelled, but the CLI did not report it so: {summary.cancels.get(id_)}")


def reconcile_tls(
    rows: dict[int, Any],
    tries: dict[int, list[Any]],
    sends: list[SendRequest],
    summary: Summary,
    problem: Callable[[int, str], None],
) -> None:
    """Every send answered with a corrupt TLS record (after moto took it) is ambiguous: an
    ``ambiguous``/``SSLError`` attempt; hold mail is parked as ``unknown_outcome`` and never
    sent again (one request, received once)."""
    faulted = [s for s in sends if s.kind == "tls_corrupt" and s.outbox_id is not None]
    summary.tls_faults = len(faulted)
    for send in faulted:
        id_ = send.outbox_id
        assert id_ is not None
        ambiguous = [
            a
            for a in tries[id_]
            if a.outcome in ("ambiguous", "stale:ambiguous") and a.error_code == "SSLError"
        ]
        if not ambiguous:
            problem(id_, f"a corrupt TLS answer, but no ambiguous SSLError attempt: {tries[id_]}")
        if rows[id_].category == "digest":
            continue
        summary.tls_held += 1
        requests = [s for s in sends if s.outbox_id == id_]
        if rows[id_].status != "unknown_outcome" or len(requests) != 1:
            problem(id_, "a corrupt TLS answer to hold mail: not parked, or sent again")


def reconcile_outage(
    rows: dict[int, Any],
    tries: dict[int, list[Any]],
    sends: list[SendRequest],
    accepted: Counter[int],
    summary: Summary,
    problem: Callable[[int, str], None],
) -> None:
    """After a database outage: no send SES accepted may have lost its outcome, neither
    parked as ``unknown_outcome`` nor swept as ``lease_expired`` (a resend row swept so is
    sent again)."""
    if summary.outage is None:
        return
    began, ended = summary.outage
    summary.outage_in_flight_accepted = sum(1 for i in summary.outage_in_flight if accepted[i])
    summary.accepted_during_outage = sum(1 for s in sends if s.accepted and began <= s.at < ended)
    for id_, row in rows.items():
        swept = any(a.outcome == "lease_expired" for a in tries[id_])
        if accepted[id_] and (row.status == "unknown_outcome" or swept):
            summary.accepted_unknown += 1
            problem(id_, "SES accepted it, but its outcome was lost to the database outage")


def reconcile_pause_window(
    rows: dict[int, Any],
    sends: list[SendRequest],
    accepted: Counter[int],
    summary: Summary,
    problem: Callable[[int, str], None],
) -> None:
    """A paused configuration set holds only its own mail: SES took none of it during the
    window and each of it exactly once, the pause used no attempt (each row sent on its first,
    the probes' refusals not counted), and other mail kept flowing meanwhile. No relay ever
    shows ``paused`` (that is an account pause)."""
    if summary.window is None:
        return
    began, ended = summary.window
    summary.marketing_refused = sum(1 for s in sends if s.kind == "config_set_paused")
    summary.window_other_sends = sum(
        1
        for s in sends
        if s.accepted and began <= s.at <= ended and s.outbox_id not in summary.marketing
    )
    for id_ in sorted(summary.marketing):
        row = rows[id_]
        times = [s.at for s in sends if s.outbox_id == id_ and s.accepted]
        if any(began <= at <= ended for at in times):
            summary.window_marketing_accepted += 1
            problem(id_, f"{PAUSED_SET} mail accepted while {PAUSED_SET} was paused")
        elif times and times[0] < began:
            summary.marketing_before += 1
        elif times:
            summary.marketing_after += 1
        if (row.status, accepted[id_], row.attempt_count) != ("sent", 1, 1):
            problem(id_, f"{PAUSED_SET} mail not sent once on its first attempt")
    if summary.relay_states["paused"]:
        summary.problems.append(
            f"a relay showed 'paused' during the {PAUSED_SET} pause: {dict(summary.relay_states)}"
        )


def attempt_tag(send: SendRequest) -> str | None:
    """The ``outbox_attempt`` tag of a SendEmail request: the claim token it was sent under."""
    for tag in send.request.get("EmailTags", []):
        if tag.get("Name") == "outbox_attempt":
            return str(tag.get("Value"))
    return None


def reconcile_events(
    engine: sa.Engine,
    ses: FaultServer,
    queue: EventQueue | None,
    rows: dict[int, Any],
    tries: dict[int, list[Any]],
    accepted: Counter[int],
    categories: dict[int, str],
    summary: Summary,
    problem: Callable[[int, str], None],
) -> None:
    """With the events on: what became of each ambiguous send of hold and reconcile mail (an
    unanswered attempt, by its claim token). If SES took it (a request with that token that
    moto accepted), its events made the row ``sent`` with that request's MessageId and it was
    never requeued; unless its events were lost, when hold mail stays ``unknown_outcome``. If
    SES never took it, reconcile mail was requeued once and then received exactly once, and
    hold mail stays ``unknown_outcome``. Reconcile mail never stays ``unknown_outcome``.
    And the intake's own books: one ``outbox_events`` row per event published, none malformed,
    no dead letter, every sent row whose Delivery event was published ``delivered``."""
    lost = lost_events(ses)
    # (row, claim token) -> moto's MessageId: a claim token names a claim, which may be a
    # batch of rows, so only with the row does it name one send
    took: dict[tuple[int, str], str] = {}
    for send in ses.sends:
        token = attempt_tag(send)
        if send.accepted and send.message_id is not None and send.outbox_id is not None:
            if token is None:
                summary.problems.append(f"SES took #{send.outbox_id} with no outbox_attempt tag")
            else:
                took[send.outbox_id, token] = send.message_id
    with engine.connect() as conn:
        recorded = conn.execute(sa.select(events.c.message_id, events.c.effect)).all()
    summary.events_recorded = len(recorded)
    summary.event_effects = Counter(r.effect for r in recorded)
    records = ses.events.records if ses.events is not None else []
    published = [r for r in records if r.copies]
    summary.events_published = len(published)
    summary.events_duplicated = sum(1 for r in records if r.copies > 1)
    summary.events_dropped = sum(1 for r in records if not r.copies) + len(lost)
    if summary.events_recorded != summary.events_published:
        summary.problems.append(
            f"{summary.events_published} events published, {summary.events_recorded} recorded"
        )
    if summary.event_effects["malformed"]:
        summary.problems.append(f"malformed events: {summary.event_effects}")
    if queue is not None:
        summary.dead_letters = queue.counts()["dead"]
        if summary.dead_letters:
            summary.problems.append(f"{summary.dead_letters} events on the dead-letter queue")
    # a row's delivery status follows the send it is sent as (its provider id); the events of
    # another send of it (resend mail sent twice) are recorded as a duplicate send, only
    delivery_published = {(r.outbox_id, r.message_id) for r in published if r.kind == "delivery"}

    for id_, row in rows.items():
        category, mine = categories[id_], tries[id_]
        if row.status == "sent":
            if row.delivery_status == "delivered":
                summary.delivered_status += 1
            elif (id_, row.provider_message_id) in delivery_published:
                problem(id_, f"its Delivery event was published, delivery {row.delivery_status}")
        requeues = [a for a in mine if a.outcome == "reconcile:requeued"]
        summary.requeued += len(requeues)
        if requeues and category != "reconcile":
            problem(id_, f"requeued by reconcile, but {category} mail is not reconcile mail")
        if len(requeues) > 1:
            problem(id_, f"requeued by reconcile {len(requeues)} times")
        if category not in HELD:
            continue  # resend mail: the relay retries an ambiguous send itself
        tokens = list(
            dict.fromkeys(
                a.claim_token
                for a in mine
                if (a.outcome in UNANSWERED or a.outcome == "reconciled") and a.claim_token
            )
        )
        if row.status == "unknown_outcome":
            summary.left_for_human += 1
            if category == "reconcile":
                summary.reconcile_left += 1
                problem(id_, f"reconcile mail left unknown_outcome: {[a.outcome for a in mine]}")
        if not tokens:
            if requeues:
                problem(id_, "requeued by reconcile with no ambiguous send")
            continue
        summary.ambiguous_rows += 1
        summary.ambiguous_sends += len(tokens)
        first = (id_, tokens[0])
        if first in took:
            summary.ambiguous_reached += 1
            provider_id = took[first]
            if provider_id in lost:
                summary.events_lost_ambiguous += 1
                if category != "reconcile" and row.status != "unknown_outcome":
                    problem(id_, "its ambiguous send's events were lost, yet it moved")
            elif (row.status, row.provider_message_id, len(requeues)) == ("sent", provider_id, 0):
                summary.resolved_by_events += 1
            else:
                problem(
                    id_,
                    f"its ambiguous send reached SES as {provider_id}, yet it ended "
                    f"{row.status} with {row.provider_message_id}, requeued {len(requeues)}",
                )
        elif category == "reconcile":
            if (row.status, accepted[id_], len(requeues)) == ("sent", 1, 1):
                summary.requeued_delivered += 1
            else:
                problem(
                    id_,
                    f"its ambiguous send never reached SES: requeued {len(requeues)}, "
                    f"ended {row.status}, received {accepted[id_]}",
                )
        elif row.status != "unknown_outcome" or requeues:
            problem(id_, "hold mail whose ambiguous send never reached SES moved without a human")


def reconcile_restarts(tries: dict[int, list[Any]], summary: Summary) -> None:
    """The sends in flight at each database restart: those in flight at the last read before
    the server went down, and those whose recorded start falls after that read (less a margin,
    for a start whose mark committed just after the read) and before the server dropped the
    harness's connection (plus a margin: a server closes its connections one by one)."""
    for window in summary.restart_windows:
        since = window.last_read - RESTART_MARGIN_BEFORE
        until = window.down + RESTART_MARGIN_AFTER
        started = {
            id_
            for id_, mine in tries.items()
            for a in mine
            if a.started_at is not None and since < a.started_at.timestamp() <= until
        }
        summary.in_flight_at_faults.append(len(window.in_flight | started))


# -- one run -----------------------------------------------------------------------------------


def relay_args(sender: str) -> tuple[str, ...]:
    """The relays' settings. With the fake sender (no latency) the relays are what is measured:
    more sends at once, bigger claims, and no rate limit."""
    if sender == "fake":
        limits: tuple[str, ...] = ("--concurrency", "16", "--batch-size", "16")
    else:
        limits = ("--concurrency", "8", "--batch-size", "10", "--max-send-rate", "400")
    return (
        *limits,
        "--lease-seconds",
        str(LEASE),
        "--send-timeout",
        str(SEND_TIMEOUT),
        "--drain-seconds",
        str(SEND_TIMEOUT + 1),
        "--poll-interval",
        "0.2",
        "--pause-seconds",
        "0.5",
        "--log-level",
        "WARNING",
    )


def run(
    database_url: str,
    *,
    scenario: str,
    count: int,
    replicas: int,
    workdir: Path,
    moto: MotoSes | None = None,
    seed: int = 10,
    settle_timeout: float = 180,
    restart_command: str | None = None,
    sender: str = "ses",
    events: str | None = None,
    event_faults: bool = False,
    tick_interval: float = TICK_INTERVAL,
) -> Summary:
    """One ledger run. ``restart_command`` restarts the database server (``db_restart`` needs
    it; ``combined`` runs without a restart, and says so, when it is None). ``sender``:
    ``ses`` (moto behind the fault server) or ``fake`` (no latency; no SES faults then).
    ``events``: one of ``EVENT_MODES`` (None: ``run`` for the reconcile scenario, else
    ``off``); ``event_faults`` breaks the event stream as the module docstring says."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}: one of {', '.join(SCENARIOS)}")
    if sender not in SENDERS:
        raise ValueError(f"unknown sender {sender!r}: one of {', '.join(SENDERS)}")
    events = events or ("run" if scenario == "reconcile" else "off")
    if events not in EVENT_MODES:
        raise ValueError(f"unknown events mode {events!r}: one of {', '.join(EVENT_MODES)}")
    if events != "off" and sender != "ses":
        raise ValueError("the events come from the SES emulator: they need --sender ses")
    if event_faults and events == "off":
        raise ValueError("event faults need the events on")
    if sender == "fake" and scenario in ("ses_faults", "combined", "tls_fault", "paused_set"):
        raise ValueError(f"the {scenario} scenario injects SES faults: it needs --sender ses")
    if scenario == "db_restart" and not restart_command:
        raise ValueError("the db_restart scenario needs a restart command")
    engine = make_engine(database_url)
    own_moto = moto is None
    moto = moto or MotoSes()
    rng = random.Random(seed)
    summary = Summary(
        scenario,
        engine.dialect.name,
        count,
        replicas,
        sender=sender,
        events=events,
        event_faults=event_faults,
    )
    record = workdir / "fake-sends.log" if sender == "fake" else None
    try:
        migrations.upgrade(engine)
        empty(engine)
        moto.reset()
        warm_up(moto)
        marketing: set[int] | None = set() if scenario == "paused_set" else None
        categories = enqueue(
            engine,
            count,
            expires_in=3 + count / 60,
            marketing=marketing,
            kinds=CATEGORIES if events == "off" else EVENT_CATEGORIES,
        )
        summary.marketing = frozenset(marketing or ())
        poisoned: set[int] = set()
        if scenario == "poison":
            poisoned = set(rng.sample(sorted(i for i, c in categories.items() if c == "fast"), 3))
            poison(engine, sorted(poisoned))
        held_back = hold_xmin(engine) if scenario == "xmin" else None
        certificate = make_certificate(workdir / "tls", "ses") if scenario == "tls_fault" else None
        tls = certificate.server_context() if certificate is not None else None
        # hangs outlive the client's read timeout (an ambiguous send)
        plan = FaultPlan(seed=seed, hang_seconds=SEND_TIMEOUT + 1)
        queue = EventQueue.create(moto.url) if events != "off" else None
        with contextlib.ExitStack() as stack:
            if event_faults:
                plan.events_delay = EVENTS_DELAY
                plan.events_duplicate = EVENTS_DUPLICATE
                plan.events_reorder = EVENTS_REORDER
                server: FaultServer = LossyEvents(
                    moto.url, plan, tls=tls, events=queue, share=EVENTS_DROP_ANSWERED, seed=seed
                )
            else:
                server = FaultServer(moto.url, plan, tls=tls, events=queue)
            ses = stack.enter_context(server)
            proxy = None
            if scenario == "db_outage":
                proxy = stack.enter_context(DatabaseProxy(database_url))
            fleet = Fleet(
                database_url if proxy is None else proxy.url,
                ses.url,
                workdir,
                relay_args(sender),
                record,
                ca_bundle=certificate.cert_file if certificate is not None else None,
                events=events,
                queue=queue,
            )
            started = time.monotonic()
            try:
                for n in range(replicas):
                    skewed = scenario == "clock_skew" and n < len(CLOCK_OFFSETS)
                    fleet.start(CLOCK_OFFSETS[n] if skewed else None)
                if events == "process":
                    fleet.start_intake()
                faults = Faults(
                    engine,
                    database_url,
                    fleet,
                    ses,
                    summary,
                    rng,
                    count,
                    workdir,
                    restart_command,
                    proxy,
                )
                inject(faults, scenario)
                wait_for(
                    lambda: progress(engine, count) >= 1.0,
                    interval=POLL,
                    timeout=settle_timeout,
                    what=f"every row settled ({dict(statuses(engine))})",
                )
                summary.runtime = time.monotonic() - started
                if queue is not None:
                    await_truth(engine, ses, queue, categories, summary, count, tick_interval)
                fleet.stop_all(summary, engine)
            finally:
                fleet.kill_all()
            if proxy is not None and proxy.errors:
                summary.problems.append(f"database proxy errors: {proxy.errors[:3]}")
            if scenario == "paused_set":
                for proc in fleet.started:
                    if "sending paused (account" in proc.output():
                        summary.problems.append(f"{proc.relay_id} paused all sending")
            reconcile(engine, ses, categories, summary, poisoned, record, queue)
        if held_back is not None:
            if not held_back.in_transaction():
                summary.problems.append("the xmin-holding transaction ended early")
            summary.xmin_held = held_back.execute(
                sa.text(
                    "SELECT backend_xmin IS NOT NULL FROM pg_stat_activity "
                    "WHERE pid = pg_backend_pid()"
                )
            ).scalar_one()
            held_back.close()
        if scenario == "sigterm" and summary.unknown:
            summary.problems.append(f"SIGTERM drains left {summary.unknown} unknown_outcome rows")
    finally:
        engine.dispose()
        if own_moto:
            moto.stop()
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--relays", type=int, default=3)
    parser.add_argument("--scenario", choices=SCENARIOS, default="sigkill")
    parser.add_argument("--seed", type=int, default=10)
    parser.add_argument(
        "--restart-command",
        help="shell command that restarts the database server (db_restart, combined)",
    )
    parser.add_argument(
        "--sender",
        choices=SENDERS,
        default="ses",
        help="ses: moto behind the fault server; fake: no latency, the relays' own throughput",
    )
    parser.add_argument(
        "--events",
        choices=EVENT_MODES,
        help="the SES event intake: in every relay (run), one events process beside them "
        "(process) or off (default: run for the reconcile scenario, off for the others)",
    )
    parser.add_argument(
        "--event-faults",
        action="store_true",
        help="events late, duplicated, out of order, and those of some answered sends lost",
    )
    parser.add_argument(
        "--tick-interval",
        type=float,
        default=TICK_INTERVAL,
        help="seconds between two messages of the trickle after the chaos",
    )
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ledger-") as workdir:
        summary = run(
            options.database_url,
            scenario=options.scenario,
            count=options.messages,
            replicas=options.relays,
            workdir=Path(workdir),
            seed=options.seed,
            settle_timeout=max(180, options.messages / 10),
            restart_command=options.restart_command,
            sender=options.sender,
            events=options.events,
            event_faults=options.event_faults,
            tick_interval=options.tick_interval,
        )
    print(summary.line())
    for problem in summary.problems[:50]:
        print("  PROBLEM", problem)
    return 1 if summary.problems else 0


if __name__ == "__main__":
    sys.exit(main())
