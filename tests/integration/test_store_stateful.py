"""A stateful test of ``relay.store``: two simulated relays, an operator and a clock.

The machine drives the store the way ``relay/worker.py`` does (claim -> mark -> provider call
-> decide -> guarded transition + attempt row; sweep -> decide(LeaseExpired) -> transition with
``expired_before``), but with the steps apart, so any interleaving hypothesis finds is one the
store must survive: a relay that stalls past its lease and finalizes with a stale claim, a
sweep between a claim and its mark, an operator requeue while an old send is still in flight.
The clock is the machine's own; it jumps, sometimes past every lease.

Each relay keeps its own view (its claims, which it marked, which it sent); the machine keeps
the delivery ledger (what the provider may have received) and, from the database read after
every step, checks that no row is held under two live claims, that no row is claimed or marked
again after ``unknown_outcome`` unless an operator requeued it, that a message reaches the
provider twice only under the ``resend`` policy or after a requeue, that every transition is
one the state machine allows (docs/design.md, "The state machine"), and that a final sweep
leaves nothing in ``processing``.

``RacingSweepMachine`` also pulls the sweep's read and write apart, as two replicas at READ
COMMITTED do: the holder of a row may act in between.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy.orm import Session

from outbox import AmbiguityPolicy, Category, Email, Outbox, Status
from outbox.schema import attempts, messages, relays
from relay import store
from relay.db import make_engine as relay_engine
from relay.policy import Action, Decision, LeaseExpired, decide
from relay.senders import Accepted, Ambiguous, Disabled, Outcome, Permanent, Transient

# A fixed instant after the wall clock: ``not_before`` pins next_attempt_at to the machine's
# clock, and a failing run replays the same timestamps.
T0 = datetime(2099, 1, 1, 12, 0, tzinfo=UTC)
LEASE_SECONDS = 30.0
LEASE = timedelta(seconds=LEASE_SECONDS)
RELAYS = ("r1", "r2")
CATEGORIES = (
    Category(name="hold2", max_attempts=2, backoff_base=1.0, backoff_cap=20.0),
    Category(name="hold4", max_attempts=4, backoff_base=1.0, backoff_cap=20.0),
    Category(
        name="resend2",
        max_attempts=2,
        backoff_base=1.0,
        backoff_cap=20.0,
        ambiguity=AmbiguityPolicy.RESEND,
    ),
    Category(
        name="resend4",
        max_attempts=4,
        backoff_base=1.0,
        backoff_cap=20.0,
        ambiguity=AmbiguityPolicy.RESEND,
    ),
)
OUTBOX = Outbox(categories=CATEGORIES)

P, R, X = Status.PENDING, Status.RETRYING, Status.PROCESSING
ALLOWED = {  # status -> statuses one step of a relay (never an operator's requeue) may leave
    Status.PENDING: {P, X, Status.EXPIRED, Status.CANCELLED},
    Status.RETRYING: {R, X, Status.EXPIRED, Status.CANCELLED},
    Status.PROCESSING: {X, P, R, Status.SENT, Status.FAILED, Status.UNKNOWN_OUTCOME},
    Status.SENT: {Status.SENT},
    Status.FAILED: {Status.FAILED},
    Status.UNKNOWN_OUTCOME: {Status.UNKNOWN_OUTCOME},
    Status.CANCELLED: {Status.CANCELLED},
    Status.EXPIRED: {Status.EXPIRED},
}
AFTER = {
    Action.SENT: Status.SENT,
    Action.RETRY: Status.RETRYING,
    Action.FAIL: Status.FAILED,
    Action.HOLD: Status.UNKNOWN_OUTCOME,
}
OUTCOME_NAMES = {
    Accepted: "accepted",
    Transient: "transient",
    Permanent: "permanent",
    Ambiguous: "ambiguous",
    Disabled: "disabled",
}

outcomes = st.one_of(
    st.builds(Accepted, provider_message_id=st.just("ses-id")),
    st.builds(Transient, code=st.just("Throttling"), throttled=st.booleans()),
    st.builds(Permanent, code=st.just("MessageRejected")),
    st.builds(Ambiguous, code=st.just("ReadTimeout")),
    st.builds(Disabled, code=st.just("AccountSendingPaused")),
)
relay_ids = st.sampled_from(RELAYS)
ENQUEUE_ARGS = {
    "count": st.integers(1, 3),
    "category": st.sampled_from([c.name for c in CATEGORIES]),
    "priority": st.integers(0, 1),
    "delay": st.sampled_from([0, 0, 0, 10, 120]),  # seconds until due
    "expires_in": st.sampled_from([None, None, None, 5, 600]),  # seconds after due
}
picks = st.integers(min_value=0, max_value=50)
later = st.sampled_from([0, 0, int(LEASE_SECONDS * 1000) + 1, 60_000])  # ms before a sweep
clock_steps = st.one_of(  # milliseconds: mostly within a lease, sometimes around its end or past
    st.integers(0, 5_000),
    st.integers(0, 5_000),
    st.integers(25_000, 40_000),
    st.integers(60_000, 1_800_000),
)


@dataclass(kw_only=True)
class Delivery:
    """One provider call the ledger knows of; ``refused`` when the provider said it took
    nothing (transient, permanent, disabled). Otherwise the message may have gone out."""

    message_id: int
    relay_id: str
    claim_token: str
    epoch: int
    refused: bool = False


@dataclass(kw_only=True)
class Hold:
    """What one relay believes it holds: a claim, whether it marked it, its send in flight."""

    claim: store.Claim
    epoch: int  # the message's requeue count when the claim was taken
    marked: bool = False
    delivery: Delivery | None = None

    @property
    def key(self) -> tuple[int, str]:
        return self.claim.id, self.claim.claim_token


@dataclass(kw_only=True)
class RelayView:
    relay_id: str
    holds: dict[tuple[int, str], Hold] = field(default_factory=dict)
    sweep_read: tuple[datetime, list[store.StaleLease]] | None = None


def read_rows(engine: sa.Engine) -> dict[int, sa.Row]:
    with engine.connect() as conn:
        return {row.id: row for row in conn.execute(sa.select(messages).order_by(messages.c.id))}


def read_attempts(engine: sa.Engine) -> collections.Counter[tuple[int, str | None, str]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(attempts.c.message_id, attempts.c.claim_token, attempts.c.outcome)
        )
        return collections.Counter((r.message_id, r.claim_token, r.outcome) for r in rows)


def ordered(stale: list[store.StaleLease]) -> list[store.StaleLease]:
    """Candidates in a replayable order (the store orders by lease only; ties vary)."""
    return sorted(stale, key=lambda s: (s.claim.lease_expires_at, s.claim.id))


def empty_outbox(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        for table in (attempts, messages, relays):
            conn.execute(table.delete())


class StoreMachine(RuleBasedStateMachine):
    """Two relays and an operator on one outbox; bind ``engine`` in a subclass."""

    engine: sa.Engine

    def __init__(self) -> None:
        super().__init__()
        empty_outbox(self.engine)
        self.now = T0
        self.rng = random.Random(0)
        self.relays = {r: RelayView(relay_id=r) for r in RELAYS}
        self.rows: dict[int, sa.Row] = {}  # the database after the previous step
        self.policy: dict[int, AmbiguityPolicy] = {}
        self.epoch: collections.Counter[int] = collections.Counter()  # requeues per message
        self.unknown_seen: set[int] = set()  # unknown_outcome since the last requeue
        self.deliveries: list[Delivery] = []
        self.expected_attempts: collections.Counter[tuple[int, str | None, str]] = (
            collections.Counter()
        )
        self.marked: set[tuple[int, str]] = set()  # every (id, claim token) a relay marked
        self.requeued: set[int] = set()  # by the current step
        self.enqueued = 0

    # -- helpers ---------------------------------------------------------------------------

    def held(self, row: sa.Row, token: str) -> bool:
        return row.status == X and row.claim_token == token

    def fresh(self, message_id: int, conn: sa.Connection | None = None) -> sa.Row:
        query = sa.select(messages).where(messages.c.id == message_id)
        if conn is not None:
            return conn.execute(query).one()
        with self.engine.connect() as own:
            return own.execute(query).one()

    def pick(self, items: list, pick: int):
        return items[pick % len(items)]

    def finalize(self, view: RelayView, hold: Hold, outcome: Outcome) -> None:
        """The relay's provider call returned ``outcome``: decide, apply, record the attempt."""
        before = self.rows[hold.claim.id]
        expect = self.held(before, hold.claim.claim_token)
        decision = decide(outcome, hold.claim.state, self.now, self.rng)
        name = OUTCOME_NAMES[type(outcome)]
        with self.engine.begin() as conn:
            ok = store.apply_decision(conn, hold.claim, decision, self.now)
            name = name if ok else f"stale:{name}"
            store.record_attempts(
                conn,
                [
                    store.AttemptRecord(
                        message_id=hold.claim.id,
                        claim_token=hold.claim.claim_token,
                        relay_id=view.relay_id,
                        started_at=self.now,
                        finished_at=self.now,
                        outcome=name,
                        error_code=decision.code,
                        error_message=decision.message,
                        provider_message_id=decision.provider_message_id,
                    )
                ],
            )
        self.expected_attempts[(hold.claim.id, hold.claim.claim_token, name)] += 1
        assert ok == expect, f"{view.relay_id}'s finalize of {hold.key} applied={ok}: {before}"
        del view.holds[hold.key]
        stale = "" if ok else f" (stale claim; the row is {before.status})"
        event(f"finalize {decision.action}{stale}")
        if hold.delivery is not None and isinstance(outcome, Transient | Permanent | Disabled):
            hold.delivery.refused = True
        if ok:
            self.check_applied(before, decision, hold.claim.attempt_count)

    def check_applied(
        self,
        before: sa.Row,
        decision: Decision,
        attempts_before: int,
        conn: sa.Connection | None = None,
    ) -> None:
        after = self.fresh(before.id, conn)
        assert after.claim_token is None
        assert after.lease_expires_at is None
        if decision.action is Action.RELEASE:
            assert after.status == (P if attempts_before == 0 else R)
            assert after.attempt_count == attempts_before
            assert after.next_attempt_at == before.next_attempt_at
            assert after.send_started_at is None
        else:
            assert after.status == AFTER[decision.action]
            assert after.attempt_count == attempts_before + 1
        if decision.action is Action.RETRY:
            assert after.next_attempt_at == decision.next_attempt_at

    def settle(
        self,
        conn: sa.Connection,
        view: RelayView,
        now: datetime,
        stale: list[store.StaleLease],
        rows: dict[int, sa.Row],
    ) -> None:
        """The write half of ``store.sweep_expired_leases``, ``store.settle_expired_leases``,
        on the leases ``sweep_candidates`` read at ``now``. ``rows``: the rows as they are
        when the sweep writes."""
        results = store.settle_expired_leases(
            conn, stale, now=now, relay_id=view.relay_id, rng=self.rng
        )
        self.check_swept(conn, now, results, rows)

    def check_swept(
        self,
        conn: sa.Connection,
        now: datetime,
        results: list[tuple[store.StaleLease, Decision, bool]],
        rows: dict[int, sa.Row],
    ) -> None:
        for lease, decision, ok in results:
            before = rows[lease.claim.id]
            if ok and decision.action is Action.RELEASE:  # "provably unsent": never marked
                assert (lease.claim.id, lease.claim.claim_token) not in self.marked, (
                    f"the sweep released message {lease.claim.id} as never started, but "
                    f"its holder marked it (send_started_at) and may be sending it"
                )
            expect = self.held(before, lease.claim.claim_token) and before.lease_expires_at < now
            if decision.action is Action.RELEASE:
                expect = expect and before.send_started_at is None
            assert ok == expect, f"sweep of {lease.claim.id} applied={ok}, row: {before}"
            event(f"sweep {decision.action}" + ("" if ok else " (lost the race)"))
            if not ok:
                continue
            assert decision.action in (Action.RELEASE, Action.RETRY, Action.HOLD)
            if lease.send_started_at is not None:
                self.expected_attempts[
                    (lease.claim.id, lease.claim.claim_token, "lease_expired")
                ] += 1
            self.check_applied(before, decision, lease.claim.attempt_count, conn)

    def expired_leases(self) -> set[int]:
        return {i for i, r in self.rows.items() if r.status == X and r.lease_expires_at < self.now}

    def overdue(self) -> list[int]:
        return [
            i
            for i, r in self.rows.items()
            if r.status in (P, R) and r.expires_at is not None and r.expires_at <= self.now
        ]

    def holds(self, which) -> list[tuple[RelayView, Hold]]:
        return [(v, h) for v in self.relays.values() for h in v.holds.values() if which(h)]

    # -- the application and the operator --------------------------------------------------

    def enqueue(self, count, category, priority, delay, expires_in):
        not_before = self.now + timedelta(seconds=delay)
        expires_at = None if expires_in is None else not_before + timedelta(seconds=expires_in)
        with Session(self.engine) as session, session.begin():
            for _ in range(count):
                self.enqueued += 1
                n = self.enqueued
                email = Email(
                    sender="shop@example.com", to=[f"c{n}@example.com"], subject=f"#{n}", text="."
                )
                result = OUTBOX.enqueue(
                    session,
                    email,
                    key=f"order:{n}",
                    category=category,
                    priority=priority,
                    not_before=not_before,
                    expires_at=expires_at,
                )
                assert not result.duplicate
                policy = next(c.ambiguity for c in CATEGORIES if c.name == category)
                self.policy[result.id] = policy

    @initialize(**ENQUEUE_ARGS)
    def first_messages(self, **kw):
        self.enqueue(**kw)

    @rule(**ENQUEUE_ARGS)
    def more_messages(self, **kw):
        """The application enqueues (some with the resend policy, some due later, some with an
        ``expires_at``)."""
        self.enqueue(**kw)

    @rule(ms=clock_steps)
    def advance_clock(self, ms):
        self.now += timedelta(milliseconds=ms)

    @precondition(
        lambda self: any(
            r.status in (Status.UNKNOWN_OUTCOME, Status.FAILED) for r in self.rows.values()
        )
    )
    @rule(pick=picks, any_row=st.booleans())
    def operator_requeues(self, pick, any_row):
        """An operator requeues an unknown_outcome or failed row (or tries another one)."""
        stuck = [
            i for i, r in self.rows.items() if r.status in (Status.UNKNOWN_OUTCOME, Status.FAILED)
        ]
        message_id = self.pick(sorted(self.rows) if any_row else stuck, pick)
        expect = self.rows[message_id].status in (Status.UNKNOWN_OUTCOME, Status.FAILED)
        with self.engine.begin() as conn:
            ok = store.requeue(conn, message_id=message_id, now=self.now)
        assert ok == expect, f"requeue of a {self.rows[message_id].status} row applied={ok}"
        event(f"requeue applied={ok}")
        if ok:
            self.requeued.add(message_id)
            self.epoch[message_id] += 1
            self.unknown_seen.discard(message_id)
            row = self.fresh(message_id)
            assert (row.status, row.attempt_count, row.next_attempt_at) == (P, 0, self.now)
            assert row.claim_token is None
            assert row.send_started_at is None

    @precondition(lambda self: any(r.status in (P, R) for r in self.rows.values()))
    @rule(pick=picks)
    def operator_cancels(self, pick):
        message_id = self.pick(sorted(self.rows), pick)
        expect = self.rows[message_id].status in (P, R)
        with self.engine.begin() as conn:
            ok = store.cancel(conn, message_id=message_id, now=self.now)
        assert ok == expect, f"cancel of a {self.rows[message_id].status} row applied={ok}"
        event(f"cancel applied={ok}")

    @precondition(lambda self: self.overdue())
    @rule()
    def expire_overdue(self):
        """The relay's scan for rows past ``expires_at`` that are not due yet."""
        with self.engine.begin() as conn:
            gone = store.expire(conn, now=self.now)
        assert sorted(g.id for g in gone) == sorted(self.overdue())

    # -- the relays ------------------------------------------------------------------------

    @precondition(lambda self: any(r.status in (P, R) for r in self.rows.values()))
    @rule(
        relay=relay_ids,
        ms=st.sampled_from([0, 0, 2_000]),
        limit=st.integers(1, 4),
        then=st.sampled_from(["wait", "mark", "send"]),
    )
    def claim(self, relay, ms, limit, then):
        """``ms`` later, a relay claims due rows; then it waits, or marks them in the same tick
        (as ``Relay.step`` does when nothing holds it up), and maybe sends them at once."""
        self.now += timedelta(milliseconds=ms)
        view = self.relays[relay]
        with self.engine.begin() as conn:
            claims, gone = store.claim_batch(
                conn, relay_id=relay, limit=limit, now=self.now, lease_seconds=LEASE_SECONDS
            )
        due = sorted(
            (r for r in self.rows.values() if r.status in (P, R) and r.next_attempt_at <= self.now),
            key=lambda r: (r.priority, r.next_attempt_at, r.id),
        )[:limit]
        claimed = [c.id for c in claims]
        assert set(claimed) | {g.id for g in gone} == {r.id for r in due}
        assert claimed == [r.id for r in due if r.id in claimed], "claims come in send order"
        assert len({c.claim_token for c in claims}) <= 1
        event(f"claimed {len(claims)}, expired {len(gone)}")
        for g in gone:
            assert self.rows[g.id].expires_at <= self.now
        for c in claims:
            before = self.rows[c.id]
            # nothing is ever sent automatically after unknown_outcome: never claimed again
            assert before.status in (P, R), f"claimed a {before.status} row"
            assert c.id not in self.unknown_seen, f"claimed {c.id}: unknown_outcome, no requeue"
            assert before.expires_at is None or before.expires_at > self.now
            assert c.lease_expires_at == self.now + LEASE
            assert c.attempt_count == before.attempt_count
            hold = Hold(claim=c, epoch=self.epoch[c.id])
            view.holds[hold.key] = hold
        if then != "wait" and claims:
            wave = [view.holds[(c.id, c.claim_token)] for c in claims]
            self.start_wave(view, wave, send=then == "send", rows=read_rows(self.engine))

    def start_wave(
        self, view: RelayView, wave: list[Hold], send: bool, rows: dict[int, sa.Row] | None = None
    ) -> None:
        """Mark a wave, one statement per claim token, as ``Relay._start_ready`` does; with
        ``send`` the provider calls go out at once. ``rows``: the rows now, if not
        ``self.rows``."""
        rows = self.rows if rows is None else rows
        tokens = collections.defaultdict(list)
        for h in wave:
            tokens[h.claim.claim_token].append(h.claim.id)
        marked: set[tuple[int, str]] = set()
        with self.engine.begin() as conn:
            for token, ids in tokens.items():
                got = store.mark_send_started(conn, ids=ids, claim_token=token, now=self.now)
                marked |= {(i, token) for i in got}
        for h in wave:
            before = rows[h.claim.id]
            # the store lets a relay mark only a row it holds: never an unknown_outcome one
            assert (h.key in marked) == self.held(before, h.claim.claim_token), (
                f"{view.relay_id} marked={h.key in marked} {h.key}; the row: {before}"
            )
            event(f"mark applied={h.key in marked}")
            if h.key not in marked:  # lease lost before the send started: never sent
                del view.holds[h.key]
                continue
            h.marked = True
            self.marked.add(h.key)
            if send:
                self.provider_receives(view, h, rows)

    @precondition(lambda self: self.holds(lambda h: not h.marked))
    @rule(pick=picks, count=st.integers(1, 4), send=st.booleans())
    def mark_send_started(self, pick, count, send):
        """A relay starts a wave: only the rows marked here may be sent. With ``send`` the
        provider calls go out at once; otherwise they are delayed (a slow thread, a pause)."""
        view, _ = self.pick(self.holds(lambda h: not h.marked), pick)
        self.start_wave(view, [h for h in view.holds.values() if not h.marked][:count], send)

    def provider_receives(
        self, view: RelayView, hold: Hold, rows: dict[int, sa.Row] | None = None
    ) -> None:
        """The delivery ledger: the provider got this message from this relay."""
        assert hold.marked, "a relay sends only what it claimed and marked"
        message_id = hold.claim.id
        status = (self.rows if rows is None else rows)[message_id].status
        # A send belongs to the epoch of its claim: no claim is taken after unknown_outcome
        # without a requeue, so an unknown row is reached only by the attempt that made it so.
        if hold.epoch == self.epoch[message_id] and message_id in self.unknown_seen:
            assert status == Status.UNKNOWN_OUTCOME
        event(f"send while the row is {status}")
        hold.delivery = Delivery(
            message_id=message_id,
            relay_id=view.relay_id,
            claim_token=hold.claim.claim_token,
            epoch=hold.epoch,
        )
        self.deliveries.append(hold.delivery)

    @precondition(lambda self: self.holds(lambda h: h.marked and h.delivery is None))
    @rule(pick=picks)
    def send(self, pick):
        """A delayed provider call goes out."""
        view, hold = self.pick(self.holds(lambda h: h.marked and h.delivery is None), pick)
        self.provider_receives(view, hold)

    @precondition(lambda self: self.holds(lambda h: h.delivery is not None))
    @rule(pick=picks, outcome=outcomes)
    def finish_send(self, pick, outcome):
        """The provider call returns; the relay finalizes, with a stale claim or not."""
        view, hold = self.pick(self.holds(lambda h: h.delivery is not None), pick)
        self.finalize(view, hold, outcome)

    def renew(self, view: RelayView, flying: list[Hold]) -> None:
        until = self.now + LEASE
        tokens = collections.defaultdict(list)
        for h in flying:
            tokens[h.claim.claim_token].append(h.claim.id)
        kept: set[tuple[int, str]] = set()
        with self.engine.begin() as conn:
            for token, ids in tokens.items():
                got = store.extend_lease(conn, ids=ids, claim_token=token, until=until)
                kept |= {(i, token) for i in got}
        for h in flying:
            assert (h.key in kept) == self.held(self.rows[h.claim.id], h.claim.claim_token), (
                f"{view.relay_id} renewed={h.key in kept} {h.key}; the row: {self.rows[h.claim.id]}"
            )
            event(f"extend applied={h.key in kept}")
            if h.key in kept:
                h.claim = dataclasses.replace(h.claim, lease_expires_at=until)

    @precondition(lambda self: self.holds(lambda h: h.marked))
    @rule(pick=picks)
    def extend_leases(self, pick):
        """A relay renews the leases of its sends in flight (as ``Relay._extend_leases``)."""
        view, _ = self.pick(self.holds(lambda h: h.marked), pick)
        self.renew(view, [h for h in view.holds.values() if h.marked])

    @precondition(lambda self: self.holds(lambda h: not h.marked))
    @rule(pick=picks)
    def drain(self, pick):
        """A relay is stopping: it gives back what it claimed and never started."""
        view, _ = self.pick(self.holds(lambda h: not h.marked), pick)
        ready = [h for h in view.holds.values() if not h.marked]
        tokens = collections.defaultdict(list)
        for h in ready:
            tokens[h.claim.claim_token].append(h.claim.id)
        with self.engine.begin() as conn:
            for token, ids in tokens.items():
                released = store.release_unstarted(conn, ids=ids, claim_token=token, now=self.now)
                held = sum(self.held(self.rows[i], token) for i in ids)
                assert released == held, f"drain released {released} of {ids}, {held} held"
        for h in ready:
            before = self.rows[h.claim.id]
            applied = self.held(before, h.claim.claim_token)
            event(f"drain release applied={applied}")
            if applied:
                self.check_applied(before, Decision(action=Action.RELEASE), h.claim.attempt_count)
            del view.holds[h.key]

    @precondition(lambda self: any(r.status == X for r in self.rows.values()))
    @rule(relay=relay_ids, ms=later)
    def sweep(self, relay, ms=0):
        """``ms`` later, a relay's sweep of expired leases in one transaction: the two halves
        of ``store.sweep_expired_leases``, with the candidates in a replayable order (each
        retry draws its jitter, so the order must not vary from run to run)."""
        self.now += timedelta(milliseconds=ms)
        with self.engine.begin() as conn:
            stale = ordered(store.sweep_candidates(conn, now=self.now))
            assert {s.claim.id for s in stale} == self.expired_leases()
            self.settle(conn, self.relays[relay], self.now, stale, self.rows)

    @rule(relay=relay_ids, ms=later, limit=st.integers(1, 4))
    def tick(self, relay, ms, limit):
        """``ms`` later, one whole tick of a relay's loop (``Relay.step``): sweep, claim, mark
        and send at once; the other relay may be the one that stalled."""
        if any(r.status == X for r in self.rows.values()):
            self.sweep(relay, ms)
            ms = 0
            self.check_state()  # as if the sweep were a step of its own
        self.claim(relay, ms, limit, "send")

    # -- checks after every step -----------------------------------------------------------

    @invariant()
    def check_state(self):
        self.database_agrees()
        self.no_row_held_twice()
        self.delivered_twice_only_when_allowed()

    def database_agrees(self):
        rows = read_rows(self.engine)
        assert set(self.rows) <= set(rows), "a message row disappeared"
        assert len(rows) == len(self.policy)
        for message_id, row in rows.items():
            status = Status(row.status)  # one of the 8 statuses, or this raises
            before = self.rows.get(message_id)
            if before is not None:
                allowed = ALLOWED[Status(before.status)]
                if message_id in self.requeued:
                    allowed = {P}
                assert status in allowed, f"{message_id}: {before.status} -> {status}"
                if message_id in self.requeued:
                    assert row.attempt_count == 0
                else:
                    assert row.attempt_count in (before.attempt_count, before.attempt_count + 1)
            else:
                assert status == P
                assert row.attempt_count == 0
            assert 0 <= row.attempt_count <= row.max_attempts
            if status == P:
                assert row.attempt_count == 0
            if status == R:
                assert row.attempt_count >= 1
            if status == Status.SENT:
                assert row.provider_message_id, f"sent row {message_id} without a provider id"
            if status == Status.FAILED:
                assert row.last_error_code, f"failed row {message_id} without an error code"
            if status == X:
                assert row.claim_token
                assert row.claimed_by in RELAYS
                assert row.lease_expires_at is not None
            elif status != Status.EXPIRED:
                assert row.claim_token is None
                assert row.lease_expires_at is None
            if status == Status.UNKNOWN_OUTCOME:
                self.unknown_seen.add(message_id)
        self.rows = rows
        self.requeued = set()
        assert read_attempts(self.engine) == self.expected_attempts

    def no_row_held_twice(self):
        for view in self.relays.values():
            for hold in view.holds.values():
                if hold.claim.lease_expires_at >= self.now:
                    row = self.rows[hold.claim.id]
                    assert self.held(row, hold.claim.claim_token), (
                        f"{view.relay_id} holds {hold.key} under a live lease, but the row is "
                        f"{row.status} with token {row.claim_token}"
                    )
        for message_id, row in self.rows.items():
            if row.status != X:
                continue
            live = [
                view.relay_id
                for view in self.relays.values()
                if (hold := view.holds.get((message_id, row.claim_token))) is not None
                and hold.claim.lease_expires_at >= self.now
            ]
            assert len(live) <= 1, f"{message_id} held by {live}"

    def delivered_twice_only_when_allowed(self):
        counts = collections.Counter(
            (d.message_id, d.epoch) for d in self.deliveries if not d.refused
        )
        for (message_id, epoch), n in counts.items():
            if n > 1:
                event("a resend message may have reached the provider twice")
                assert self.policy[message_id] is AmbiguityPolicy.RESEND, (
                    f"message {message_id} ({self.policy[message_id]}) may have reached the "
                    f"provider {n} times since requeue #{epoch}: "
                    f"{[d for d in self.deliveries if d.message_id == message_id]}"
                )

    def teardown(self):
        if sys.exc_info()[0] is not None:  # a step failed: report that, not this
            return
        leases = [r.lease_expires_at for r in self.rows.values() if r.status == X]
        self.now = max([self.now, *leases]) + timedelta(hours=1)
        with self.engine.begin() as conn:  # the relay's own sweep, now that order is moot
            swept = store.sweep_expired_leases(conn, now=self.now, relay_id=RELAYS[0], rng=self.rng)
            assert {lease.claim.id for lease, _ in swept} == self.expired_leases()
            self.check_swept(conn, self.now, [(s, d, True) for s, d in swept], self.rows)
        self.database_agrees()
        assert not [i for i, r in self.rows.items() if r.status == X], "rows left processing"
        for view in self.relays.values():
            for hold in [h for h in view.holds.values() if h.delivery is not None]:
                self.finalize(view, hold, Accepted(provider_message_id="late"))
        self.check_state()
        assert not [i for i, r in self.rows.items() if r.status == X], "rows left processing"


class RacingSweepMachine(StoreMachine):
    """Sweeps whose read and write are apart, as between replicas at READ COMMITTED (the
    relay's level on PostgreSQL and MariaDB): the holder of a row the sweep read may mark,
    renew or finalize it before the sweep's UPDATE, which then sees the row as it is now.
    The relay's sweep locks what it reads (so a holder would wait instead); these read
    without locking, to show the guarded writes alone keep a stale read safe."""

    # Not rules here, to leave more steps to the race: every sweep races (teardown still
    # sweeps), rows are neither cancelled nor expired nor given back by a drain, and no tick
    # marks its claims at once.
    sweep = tick = operator_cancels = expire_overdue = drain = None

    @precondition(lambda self: any(r.status == X for r in self.rows.values()))
    @rule(relay=relay_ids, ms=later, data=st.data())
    def sweep_racing_the_holders(self, relay, ms, data):
        """``ms`` later, one sweep transaction; between its read and its write, the holders of
        the rows it read act. SQLite has one writer, so there the read commits first."""
        self.now += timedelta(milliseconds=ms)
        now = self.now
        with self.engine.connect() as sweeper:
            tx = sweeper.begin()
            stale = ordered(store.sweep_candidates(sweeper, now=now, lock=False))
            if self.engine.dialect.name == "sqlite":
                tx.commit()
                tx = sweeper.begin()
            for lease in stale:
                key = (lease.claim.id, lease.claim.claim_token)
                holders = [(v, v.holds[key]) for v in self.relays.values() if key in v.holds]
                if not holders:
                    continue
                ((view, hold),) = holders
                options = ["nothing", "renew"]
                options += ["finish"] if hold.delivery is not None else []
                options += ["mark"] if not hold.marked else []
                action = data.draw(st.sampled_from(options), label=f"holder of {key[0]}")
                event(f"holder acts during the sweep: {action}")
                if action == "renew":
                    self.renew(view, [hold])
                elif action == "mark":
                    self.start_wave(view, [hold], send=data.draw(st.booleans(), label="send"))
                elif action == "finish":
                    self.finalize(view, hold, data.draw(outcomes, label="outcome"))
            self.settle(sweeper, self.relays[relay], now, stale, read_rows(self.engine))
            tx.commit()

    @precondition(lambda self: self.expired_leases())
    @rule(relay=relay_ids)
    def sweep_read(self, relay):
        """A sweep reads its candidates; it writes them in a later step."""
        with self.engine.begin() as conn:
            stale = ordered(store.sweep_candidates(conn, now=self.now))
            self.relays[relay].sweep_read = (self.now, stale)

    @precondition(lambda self: any(v.sweep_read for v in self.relays.values()))
    @rule(pick=picks)
    def sweep_write(self, pick):
        view = self.pick([v for v in self.relays.values() if v.sweep_read], pick)
        read_at, stale = view.sweep_read
        view.sweep_read = None
        with self.engine.begin() as conn:
            self.settle(conn, view, read_at, stale, read_rows(self.engine))


# No shrink phase: shrinking a failure replays hundreds of examples against the database
# (minutes). To shrink one locally, add Phase.shrink to ``phases``.
SETTINGS = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def run(machine: type[StoreMachine], backend) -> None:
    """Run ``machine`` on ``backend`` through the engine ``outbox-relay run`` would make for it
    (READ COMMITTED on MariaDB); SQLite keeps the suite's engine (savepoints for enqueue)."""
    engine = backend.engine if backend.name == "sqlite" else relay_engine(backend.url)
    try:
        bound = type(machine.__name__, (machine,), {"engine": engine})
        run_state_machine_as_test(bound, settings=SETTINGS)
    finally:
        if engine is not backend.engine:
            engine.dispose()


def test_two_relays_an_operator_and_a_clock(backend):
    run(StoreMachine, backend)


def test_sweeps_racing_the_holders(backend):
    run(RacingSweepMachine, backend)


def test_a_sweep_does_not_release_a_row_whose_send_started_after_its_read(server_backend):
    """The minimal race the racing machine finds, on two real connections: a sweep reads
    (without locking, as the racing machine does) an expired lease whose send had not
    started; before its UPDATE, the holder (late, but still holding its claim) marks the row
    and calls the provider. The sweep must not then give the
    row back as "provably unsent", or another relay sends it again under the hold policy."""
    engine = relay_engine(server_backend.url)
    try:
        email = Email(sender="shop@example.com", to=["c@example.com"], subject="#1", text=".")
        with Session(engine) as session, session.begin():
            mid = OUTBOX.enqueue(session, email, category="hold4", not_before=T0).id
        with engine.begin() as conn:
            (claim,), _ = store.claim_batch(
                conn, relay_id="r1", limit=1, now=T0, lease_seconds=LEASE_SECONDS
            )
        later = T0 + LEASE + timedelta(seconds=1)
        with engine.connect() as sweeper, sweeper.begin():
            (stale,) = store.sweep_candidates(sweeper, now=later, lock=False)
            assert stale.send_started_at is None
            with engine.begin() as holder:
                marked = store.mark_send_started(
                    holder, ids=[mid], claim_token=claim.claim_token, now=later
                )
            assert marked == {mid}  # r1 now calls the provider
            decision = decide(
                LeaseExpired(send_started=False), stale.claim.state, later, random.Random(0)
            )
            assert decision.action is Action.RELEASE
            released = store.apply_decision(
                sweeper, stale.claim, decision, later, expired_before=later
            )
        row = read_rows(engine)[mid]
        with engine.begin() as conn:
            second, _ = store.claim_batch(
                conn, relay_id="r2", limit=1, now=later, lease_seconds=LEASE_SECONDS
            )
        assert (released, row.status, [c.id for c in second]) == (False, X, []), (
            "the sweep released a row whose send had started; another relay claimed it again"
        )
        # The next sweep sees the started send and parks it for an operator.
        with engine.begin() as conn:
            ((_, parked),) = store.sweep_expired_leases(
                conn, now=later, relay_id="r2", rng=random.Random(0)
            )
        assert parked.action is Action.HOLD
        assert read_rows(engine)[mid].status == Status.UNKNOWN_OUTCOME
    finally:
        engine.dispose()
