"""relay.store scenarios on SQLite, PostgreSQL and MariaDB, driven with an explicit clock.

Each test proves one rule of the state machine (docs/design.md, "The state machine") by
calling the guarded store transitions directly, with datetimes built here instead of the wall
clock. Tests that need two transactions open at the same time run on the servers only
(``server_backend``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import random
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import AmbiguityPolicy, Category, Outbox, Status
from outbox.enqueue import build_row
from outbox.schema import attempts, messages
from relay import store
from relay.db import make_engine as relay_engine
from relay.policy import Action, Decision, LeaseExpired, decide
from relay.senders import Accepted, Ambiguous, Disabled, Permanent, Transient
from tests.support import factories
from tests.support.db import attempt_rows, row
from tests.support.factories import email

# A fixed instant after the wall clock: ``not_before`` then pins next_attempt_at to it exactly,
# and every ``now`` below is built from it, never read from a clock.
T0 = datetime(2099, 1, 1, 12, 0, tzinfo=UTC)
LEASE = 60.0
RELAY = "relay-a"
RNG = random.Random(16)

OB = Outbox(
    categories=[
        Category(name="few", max_attempts=4, backoff_base=1.0, backoff_cap=4.0),
        Category(
            name="resend",
            max_attempts=3,
            backoff_base=1.0,
            backoff_cap=4.0,
            ambiguity=AmbiguityPolicy.RESEND,
        ),
    ]
)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


enqueue = functools.partial(factories.enqueue, outbox=OB, not_before=T0)
"""Enqueue through the app-side API, due at T0 unless ``not_before`` says otherwise."""


def run(engine: sa.Engine, fn: Callable[..., Any], **kw: Any) -> Any:
    """One store function in its own short transaction, as the relay calls them."""
    with engine.begin() as conn:
        return fn(conn, **kw)


def claim(
    engine: sa.Engine,
    now: datetime = T0,
    *,
    limit: int = 10,
    relay_id: str = RELAY,
    lease: float = LEASE,
) -> list[store.Claim]:
    claims, expired = run(
        engine,
        store.claim_batch,
        relay_id=relay_id,
        limit=limit,
        now=now,
        lease_seconds=lease,
    )
    assert expired == []
    return claims


def claim_one(engine: sa.Engine, now: datetime = T0, **kw: Any) -> store.Claim:
    (only,) = claim(engine, now, **kw)
    return only


def mark(engine: sa.Engine, claims: list[store.Claim], now: datetime) -> set[int]:
    (token,) = {c.claim_token for c in claims}
    return run(
        engine,
        store.mark_send_started,
        ids=[c.id for c in claims],
        claim_token=token,
        now=now,
    )


def snapshot(engine: sa.Engine, message_id: int) -> dict[str, Any]:
    return dict(row(engine, message_id, payload=True)._mapping)


def settle(engine: sa.Engine, claim: store.Claim, decision: Decision, now: datetime) -> bool:
    with engine.begin() as conn:
        return store.apply_decision(conn, claim, decision, now)


def sweep(engine: sa.Engine, now: datetime) -> list[tuple[store.StaleLease, Decision]]:
    """The relay's sweep, as one of its ticks runs it; returns the rows it moved."""
    with engine.begin() as conn:
        return store.sweep_expired_leases(conn, now=now, relay_id="sweeper", rng=RNG)


def make(engine: sa.Engine, status: Status) -> int:
    """One message brought to ``status`` through the store's own transitions."""
    if status is Status.EXPIRED:
        (mid,) = enqueue(engine, expires_at=at(30))
        assert len(run(engine, store.expire, now=at(30))) == 1
        return mid
    (mid,) = enqueue(engine)
    if status is Status.PENDING:
        return mid
    if status is Status.CANCELLED:
        assert run(engine, store.cancel, message_id=mid, now=T0)
        return mid
    c = claim_one(engine, T0)
    if status is Status.PROCESSING:
        return mid
    assert mark(engine, [c], at(1)) == {mid}
    outcome = {
        Status.SENT: Accepted(provider_message_id="ses-1"),
        Status.RETRYING: Transient(code="Throttling"),
        Status.FAILED: Permanent(code="MessageRejected"),
        Status.UNKNOWN_OUTCOME: Ambiguous(code="ReadTimeout"),
    }[status]
    assert settle(engine, c, decide(outcome, c.state, at(2), RNG), at(2))
    assert row(engine, mid).status == status
    return mid


# -- claim atomicity ---------------------------------------------------------------------


def test_second_claim_gets_nothing_while_the_first_holds_the_lease(engine):
    with Session(engine) as session, session.begin():
        mid = Outbox().enqueue(session, email(), key="order:1").id
    now = datetime.now(UTC) + timedelta(seconds=1)
    first = claim(engine, now, relay_id="relay-a")
    second = claim(engine, now, relay_id="relay-b")
    assert [c.id for c in first] == [mid]
    assert second == []
    r = row(engine, mid)
    assert r.status == Status.PROCESSING
    assert r.claim_token == first[0].claim_token
    assert r.claimed_by == "relay-a"
    assert r.claimed_at == now
    assert r.lease_expires_at == now + timedelta(seconds=LEASE) == first[0].lease_expires_at
    assert r.send_started_at is None
    assert r.attempt_count == 0


def test_each_claim_has_its_own_token_and_takes_only_up_to_its_limit(engine):
    ids = enqueue(engine, 5)
    first = claim(engine, limit=2, relay_id="relay-a")
    second = claim(engine, limit=2, relay_id="relay-b")
    third = claim(engine, limit=2, relay_id="relay-c")
    assert [c.id for c in first + second + third] == ids
    tokens = {c.claim_token for c in first}, {c.claim_token for c in second}
    assert all(len(t) == 1 for t in tokens)
    assert tokens[0] != tokens[1]
    for c in first + second + third:
        assert row(engine, c.id).claim_token == c.claim_token


@pytest.fixture
def racing_engine(server_backend) -> Iterator[sa.Engine]:
    """The engine ``outbox-relay run`` makes for its URL (so claims race under the relay's own
    settings), with lock waits failing after 5 s: a claim that waits for another instead of
    skipping its rows fails the test instead of hanging it."""
    timeout = (
        {"options": "-c lock_timeout=5000"}
        if server_backend.name == "postgresql"
        else {"init_command": "SET SESSION innodb_lock_wait_timeout = 5"}
    )
    url = sa.make_url(server_backend.url).update_query_dict(timeout)
    eng = relay_engine(url.render_as_string(hide_password=False))
    yield eng
    eng.dispose()


def _claim_on(conn: sa.Connection, relay_id: str, limit: int, now: datetime = T0):
    claims, expired = store.claim_batch(
        conn, relay_id=relay_id, limit=limit, now=now, lease_seconds=LEASE
    )
    assert expired == []
    return claims


def _assert_claimed_once(engine: sa.Engine, claims: list[store.Claim], ids: list[int]) -> None:
    """Every id claimed by exactly one claim, and the row carries that claim's token."""
    counts = collections.Counter(c.id for c in claims)
    assert sorted(counts) == sorted(ids)
    assert set(counts.values()) == {1}
    with engine.connect() as conn:
        stored = dict(conn.execute(sa.select(messages.c.id, messages.c.claim_token)).all())
    assert stored == {c.id: c.claim_token for c in claims}


def test_concurrent_claim_skips_rows_held_by_an_open_claim(server_backend, racing_engine):
    ids = enqueue(server_backend.engine, 6)
    with racing_engine.connect() as one, racing_engine.connect() as two:
        held = one.begin()
        first = _claim_on(one, "relay-a", 3)
        # relay-a's transaction is still open: its three rows are locked and uncommitted.
        with two.begin():
            second = _claim_on(two, "relay-b", 6)
        with two.begin():
            assert _claim_on(two, "relay-b", 6) == []
        held.commit()
        with two.begin():
            assert _claim_on(two, "relay-b", 6) == []
    assert [c.id for c in first] == ids[:3]
    assert [c.id for c in second] == ids[3:]
    _assert_claimed_once(server_backend.engine, first + second, ids)


def test_concurrent_claim_of_all_rows_gets_none_while_another_holds_them(
    server_backend, racing_engine
):
    ids = enqueue(server_backend.engine, 4)
    with racing_engine.connect() as one, racing_engine.connect() as two:
        with one.begin():
            first = _claim_on(one, "relay-a", 10)
            with two.begin():
                assert _claim_on(two, "relay-b", 10) == []
        with two.begin():
            assert _claim_on(two, "relay-b", 10) == []
    _assert_claimed_once(server_backend.engine, first, ids)


def test_an_open_claim_does_not_block_another_relays_finalize(server_backend, racing_engine):
    enqueue(server_backend.engine, 2)
    done, stale = claim(server_backend.engine, T0, relay_id="relay-b")
    mark(server_backend.engine, [done, stale], at(1))
    enqueue(server_backend.engine, 3)
    with racing_engine.connect() as one, racing_engine.connect() as two, one.begin():
        assert len(_claim_on(one, "relay-a", 3, at(2))) == 3
        # relay-a's claim is still open while relay-b settles rows it claimed earlier.
        with two.begin():
            now = at(3)
            sent = Accepted(provider_message_id="ses-b")
            assert store.apply_decision(two, done, decide(sent, done.state, now, RNG), now)
        with two.begin():
            now = at(LEASE + 2)
            ((lease, decision),) = store.sweep_expired_leases(
                two, now=now, relay_id="relay-b", rng=RNG
            )
            assert (lease.claim.id, decision.action) == (stale.id, Action.HOLD)
    assert row(server_backend.engine, done.id).status == Status.SENT
    assert row(server_backend.engine, stale.id).status == Status.UNKNOWN_OUTCOME


def test_a_sweep_skips_a_row_another_transaction_holds_instead_of_waiting(
    server_backend, racing_engine
):
    """A relay frozen inside its transaction (SIGSTOP, a paused VM) holds its rows' locks; the
    others' sweeps must go past those rows, not wait on them (lock waits fail after 5 s here),
    and settle them once the lock is gone."""
    enqueue(server_backend.engine, 2)
    held, free = claim(server_backend.engine, T0, relay_id="relay-frozen")
    mark(server_backend.engine, [held, free], at(1))
    now = at(LEASE + 2)
    with racing_engine.connect() as frozen, racing_engine.connect() as sweeper:
        with frozen.begin():
            # the frozen relay was finalizing ``held`` when it stopped: row locked, uncommitted
            frozen.execute(
                sa.update(messages).where(messages.c.id == held.id).values(updated_at=at(2))
            )
            with sweeper.begin():
                swept = store.sweep_expired_leases(sweeper, now=now, relay_id="relay-b", rng=RNG)
            assert [lease.claim.id for lease, _decision in swept] == [free.id]
        with sweeper.begin():  # the lock is gone (the server ended the transaction)
            swept = store.sweep_expired_leases(sweeper, now=now, relay_id="relay-b", rng=RNG)
        assert [lease.claim.id for lease, _decision in swept] == [held.id]
    assert row(server_backend.engine, held.id).status == Status.UNKNOWN_OUTCOME
    assert row(server_backend.engine, free.id).status == Status.UNKNOWN_OUTCOME


def test_a_draining_relay_does_not_block_another_relays_rows(server_backend, racing_engine):
    enqueue(server_backend.engine, 4)
    mine = claim(server_backend.engine, T0, limit=2, relay_id="relay-a")
    theirs = claim(server_backend.engine, T0, limit=2, relay_id="relay-b")
    with racing_engine.connect() as one, racing_engine.connect() as two, one.begin():
        token = mine[0].claim_token
        assert (
            store.release_unstarted(one, ids=[c.id for c in mine], claim_token=token, now=at(1))
            == 2
        )
        # relay-a's drain is still open while relay-b stamps and extends its own wave.
        with two.begin():
            ids = [c.id for c in theirs]
            other = theirs[0].claim_token
            assert store.mark_send_started(two, ids=ids, claim_token=other, now=at(2)) == set(ids)
            assert store.extend_lease(two, ids=ids, claim_token=other, until=at(90)) == set(ids)
    assert {row(server_backend.engine, c.id).status for c in mine} == {Status.PENDING}
    assert {row(server_backend.engine, c.id).send_started_at for c in theirs} == {at(2)}


def _race(engine: sa.Engine, workers: int, body: Callable[[int, sa.Connection], Any]) -> list:
    """Run ``body(i, conn)`` on ``workers`` threads, each with its own connection, started
    together; re-raise the first error."""
    start = threading.Barrier(workers)
    results: list[Any] = [None] * workers
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            with engine.connect() as conn:
                start.wait(timeout=10)
                results[i] = body(i, conn)
        except BaseException as exc:
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=target, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return results


def test_two_threads_racing_for_the_same_rows_never_share_one(server_backend, racing_engine):
    ids = enqueue(server_backend.engine, 20)
    both_claimed = threading.Barrier(2)

    def body(i: int, conn: sa.Connection) -> list[store.Claim]:
        with conn.begin():
            claims = _claim_on(conn, f"relay-{i}", 20)
            # Both claims are made before either commits: the second one ran against the
            # first's locked, uncommitted rows.
            with contextlib.suppress(threading.BrokenBarrierError):
                both_claimed.wait(timeout=10)
            return claims

    first, second = _race(racing_engine, 2, body)
    assert not both_claimed.broken
    _assert_claimed_once(server_backend.engine, first + second, ids)


def test_four_threads_claiming_batches_of_ten_take_500_rows_exactly_once(
    server_backend, racing_engine
):
    with server_backend.engine.begin() as conn:
        # 500 rows through one multi-row INSERT (OB.enqueue would take a savepoint per row).
        rows = [
            build_row(
                email(i),
                key=f"bulk:{i}",
                category=OB.categories["default"],
                priority=i % 3,
                not_before=None,
                expires_at=None,
                now=at(-(i % 7)),
            )
            for i in range(500)
        ]
        conn.execute(sa.insert(messages), rows)
        ids = list(conn.execute(sa.select(messages.c.id)).scalars())
    assert len(ids) == 500

    def body(i: int, conn: sa.Connection) -> list[store.Claim]:
        mine: list[store.Claim] = []
        while True:
            with conn.begin():
                batch = _claim_on(conn, f"relay-{i}", 10)
            if not batch:
                return mine
            assert len(batch) <= 10
            mine.extend(batch)

    per_thread = _race(racing_engine, 4, body)
    claims = [c for mine in per_thread for c in mine]
    _assert_claimed_once(server_backend.engine, claims, ids)
    assert claim(server_backend.engine, at(3600), limit=500) == []


# -- leases and the sweep ----------------------------------------------------------------


def test_an_active_lease_is_not_stolen_by_a_later_claim(engine):
    (mid,) = enqueue(engine)
    c = claim_one(engine, T0, relay_id="relay-a")
    assert claim(engine, at(1), relay_id="relay-b") == []
    assert claim(engine, at(LEASE - 1), relay_id="relay-b") == []
    # Even past its lease a processing row is never claimed: only the sweep settles it.
    assert claim(engine, at(LEASE + 3600), relay_id="relay-b") == []
    r = row(engine, mid)
    assert (r.status, r.claim_token, r.claimed_by) == (Status.PROCESSING, c.claim_token, "relay-a")


def test_an_active_lease_is_not_swept(engine):
    (mid,) = enqueue(engine)
    c = claim_one(engine, T0)
    mark(engine, [c], at(1))
    before = snapshot(engine, mid)
    assert run(engine, store.sweep_candidates, now=at(1)) == []
    assert run(engine, store.sweep_candidates, now=at(LEASE)) == []  # expires at, not before
    assert sweep(engine, at(LEASE)) == []
    assert snapshot(engine, mid) == before
    (stale,) = run(engine, store.sweep_candidates, now=at(LEASE + 0.001))
    assert stale.claim.id == mid
    assert stale.claim.claim_token == c.claim_token
    assert stale.claimed_by == RELAY
    assert stale.send_started_at == at(1)


def test_stale_lease_after_the_send_began_is_held_as_unknown_outcome(engine):
    (mid,) = enqueue(engine)
    c = claim_one(engine, T0)
    mark(engine, [c], at(1))
    ((lease, decision),) = sweep(engine, at(LEASE + 1))
    assert decision.action is Action.HOLD
    r = row(engine, mid)
    assert r.status == Status.UNKNOWN_OUTCOME
    assert r.attempt_count == 1
    assert r.claimed_by == RELAY
    assert r.claimed_at == T0
    assert r.send_started_at == at(1)
    assert r.last_attempt_at == at(1)
    assert r.last_error_code == "lease_expired_after_send_started"
    assert r.claim_token is None
    assert r.lease_expires_at is None
    assert r.sent_at is None
    assert lease.claimed_by == RELAY
    # The send that may have happened is on record for the operator, under its own claim.
    (record,) = attempt_rows(engine)
    assert (record.message_id, record.claim_token) == (mid, c.claim_token)
    assert (record.relay_id, record.outcome) == (RELAY, "lease_expired")
    assert (record.started_at, record.finished_at) == (at(1), at(LEASE + 1))
    assert record.error_code == "lease_expired_after_send_started"
    assert record.error_message == "swept by sweeper"


def test_stale_lease_after_the_send_began_is_retried_under_the_resend_policy(engine):
    (mid,) = enqueue(engine, category="resend")
    c = claim_one(engine, T0)
    mark(engine, [c], at(1))
    ((_, decision),) = sweep(engine, at(LEASE + 1))
    assert decision.action is Action.RETRY
    assert [a.outcome for a in attempt_rows(engine)] == ["lease_expired"]
    r = row(engine, mid)
    assert (r.status, r.attempt_count) == (Status.RETRYING, 1)
    assert r.next_attempt_at == decision.next_attempt_at
    assert at(LEASE + 1) <= r.next_attempt_at <= at(LEASE + 2)  # backoff_base 1 s
    assert claim_one(engine, r.next_attempt_at).attempt_count == 1


def test_stale_lease_before_the_send_began_goes_back_to_pending_uncounted(engine):
    (mid,) = enqueue(engine, not_before=at(-5))
    claim_one(engine, T0)
    ((_, decision),) = sweep(engine, at(LEASE + 1))
    assert decision.action is Action.RELEASE
    assert attempt_rows(engine) == []  # nothing was sent: no attempt to record
    r = row(engine, mid)
    assert r.status == Status.PENDING
    assert r.attempt_count == 0
    assert r.next_attempt_at == at(-5)
    assert r.claim_token is None
    assert r.lease_expires_at is None
    assert r.send_started_at is None
    assert r.last_attempt_at is None
    assert r.last_error_code == "lease_expired_before_send"
    assert claim_one(engine, at(LEASE + 2)).id == mid


def test_stale_lease_before_the_send_began_goes_back_to_retrying_uncounted(engine):
    mid = make(engine, Status.RETRYING)
    retry = row(engine, mid)
    assert retry.attempt_count == 1
    claim_one(engine, retry.next_attempt_at)
    ((_, decision),) = sweep(engine, retry.next_attempt_at + timedelta(seconds=LEASE + 1))
    assert decision.action is Action.RELEASE
    r = row(engine, mid)
    assert r.status == Status.RETRYING
    assert r.attempt_count == 1
    assert r.next_attempt_at == retry.next_attempt_at
    assert r.last_attempt_at == retry.last_attempt_at
    assert r.claim_token is None
    assert r.send_started_at is None


def test_unknown_outcome_is_never_claimed_again(engine):
    mid = make(engine, Status.UNKNOWN_OUTCOME)
    before = snapshot(engine, mid)
    # A restarted relay claims from scratch, as late as you like: the row is not reachable.
    for now in (at(3), at(3600), at(10**7)):
        assert claim(engine, now, limit=100, relay_id="restarted") == []
    assert run(engine, store.sweep_candidates, now=at(10**7)) == []
    assert len(run(engine, store.expire, now=at(10**7))) == 0
    assert snapshot(engine, mid) == before


# -- stale claimants ---------------------------------------------------------------------


def test_a_stale_claimant_cannot_finalize_after_a_sweep(engine):
    (mid,) = enqueue(engine)
    stale = claim_one(engine, T0)
    mark(engine, [stale], at(1))
    sweep(engine, at(LEASE + 1))
    before = snapshot(engine, mid)
    assert before["status"] == Status.UNKNOWN_OUTCOME
    late = at(LEASE + 5)
    sent = Accepted(provider_message_id="ses-late")
    assert not settle(engine, stale, decide(sent, stale.state, late, RNG), late)
    for outcome in (
        Transient(code="x"),
        Permanent(code="y"),
        Ambiguous(code="z"),
        Disabled(code="d"),
    ):
        assert not settle(engine, stale, decide(outcome, stale.state, late, RNG), late)
    assert snapshot(engine, mid) == before


def test_a_stale_claimant_cannot_overwrite_a_newer_claimants_result(engine):
    (mid,) = enqueue(engine)
    old = claim_one(engine, T0, relay_id="relay-old")
    sweep(engine, at(LEASE + 1))  # never marked: released to pending
    new = claim_one(engine, at(LEASE + 2), relay_id="relay-new")
    assert new.claim_token != old.claim_token
    mark(engine, [new], at(LEASE + 3))
    assert settle(
        engine, new, decide(Accepted(provider_message_id="ses-new"), new.state, at(70), RNG), at(70)
    )
    # The old claimant never marked its rows, so nothing stamps send_started for it either.
    assert (
        run(engine, store.mark_send_started, ids=[mid], claim_token=old.claim_token, now=at(71))
        == set()
    )
    before = snapshot(engine, mid)
    assert before["status"] == Status.SENT
    for outcome in (
        Accepted(provider_message_id="ses-old"),
        Transient(code="x"),
        Permanent(code="y"),
        Ambiguous(code="z"),
        Disabled(code="d"),
    ):
        assert not settle(engine, old, decide(outcome, old.state, at(72), RNG), at(72))
    assert snapshot(engine, mid) == before
    assert before["provider_message_id"] == "ses-new"
    assert before["claimed_by"] == "relay-new"


def test_a_stale_claimant_cannot_settle_a_row_another_relay_now_holds(engine):
    (mid,) = enqueue(engine)
    old = claim_one(engine, T0, relay_id="relay-old")
    sweep(engine, at(LEASE + 1))  # never marked: released to pending
    new = claim_one(engine, at(LEASE + 2), relay_id="relay-new")
    # A draining old claimant gives back nothing of the new claim, started or not.
    assert (
        run(engine, store.release_unstarted, ids=[mid], claim_token=old.claim_token, now=at(62))
        == 0
    )
    assert row(engine, mid).claim_token == new.claim_token
    mark(engine, [new], at(LEASE + 3))
    before = snapshot(engine, mid)
    assert (before["status"], before["claim_token"]) == (Status.PROCESSING, new.claim_token)
    late = at(LEASE + 4)
    for outcome in (
        Accepted(provider_message_id="ses-old"),
        Transient(code="x"),
        Permanent(code="y"),
        Ambiguous(code="z"),
        Disabled(code="d"),
    ):
        assert not settle(engine, old, decide(outcome, old.state, late, RNG), late)
    assert (
        run(engine, store.release_unstarted, ids=[mid], claim_token=old.claim_token, now=late) == 0
    )
    assert snapshot(engine, mid) == before
    assert settle(
        engine, new, decide(Accepted(provider_message_id="p"), new.state, late, RNG), late
    )


def test_a_stale_claimants_provider_message_id_is_recorded_as_an_attempt(engine):
    (mid,) = enqueue(engine)
    stale = claim_one(engine, T0)
    mark(engine, [stale], at(1))
    sweep(engine, at(LEASE + 1))
    before = snapshot(engine, mid)
    late = at(LEASE + 5)
    decision = decide(Accepted(provider_message_id="ses-0001"), stale.state, late, RNG)
    with engine.begin() as conn:
        assert not store.apply_decision(conn, stale, decision, late)
        store.record_attempts(
            conn,
            [
                store.AttemptRecord(
                    message_id=mid,
                    claim_token=stale.claim_token,
                    relay_id=RELAY,
                    started_at=at(1),
                    finished_at=late,
                    outcome="accepted",
                    provider_message_id=decision.provider_message_id,
                )
            ],
        )
    assert snapshot(engine, mid) == before
    (swept, record) = attempt_rows(engine)
    assert swept.outcome == "lease_expired"
    assert record.message_id == mid
    assert record.claim_token == stale.claim_token
    assert record.relay_id == RELAY
    assert (record.started_at, record.finished_at) == (at(1), late)
    assert record.outcome == "accepted"
    assert record.provider_message_id == "ses-0001"
    assert record.error_code is None


def test_record_attempts_with_nothing_writes_nothing(engine):
    run(engine, store.record_attempts, records=[])
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(attempts)).scalar_one() == 0


# -- outcomes ----------------------------------------------------------------------------


def test_transient_errors_retry_a_bounded_number_of_times_then_fail(engine):
    (mid,) = enqueue(engine, category="few")  # max_attempts 4, backoff 1 s .. 4 s
    now, actions = T0, []
    while len(actions) < 10:
        c = claim_one(engine, now)
        assert c.attempt_count == len(actions)
        mark(engine, [c], now)
        decision = decide(Transient(code="ServiceUnavailable", message="503"), c.state, now, RNG)
        actions.append(decision.action)
        assert settle(engine, c, decision, now)
        r = row(engine, mid)
        assert r.attempt_count == len(actions)
        assert r.last_attempt_at == now
        if decision.action is Action.FAIL:
            break
        assert r.status == Status.RETRYING
        assert r.next_attempt_at == decision.next_attempt_at
        ceiling = min(4.0, 1.0 * 2 ** (len(actions) - 1))
        assert now <= r.next_attempt_at <= now + timedelta(seconds=ceiling)
        assert claim(engine, r.next_attempt_at - timedelta(microseconds=1)) == []
        now = r.next_attempt_at
    assert actions == [Action.RETRY] * 3 + [Action.FAIL]
    r = row(engine, mid)
    assert r.status == Status.FAILED
    assert r.attempt_count == 4
    assert r.last_error_code == "ServiceUnavailable"
    assert "4 attempts exhausted" in r.last_error_message
    assert r.claim_token is None
    assert claim(engine, at(10**6)) == []


def test_a_permanent_error_fails_at_once(engine):
    (mid,) = enqueue(engine, category="few")
    c = claim_one(engine, T0)
    mark(engine, [c], at(1))
    decision = decide(Permanent(code="MessageRejected", message="bad address"), c.state, at(2), RNG)
    assert decision.action is Action.FAIL
    assert settle(engine, c, decision, at(2))
    r = row(engine, mid)
    assert (r.status, r.attempt_count) == (Status.FAILED, 1)
    assert (r.last_error_code, r.last_error_message) == ("MessageRejected", "bad address")
    assert (r.claim_token, r.lease_expires_at) == (None, None)
    assert claim(engine, at(10**6)) == []


def test_a_successful_finalize_clears_the_claim_and_records_the_send(engine):
    (mid,) = enqueue(engine)
    c = claim_one(engine, T0)
    mark(engine, [c], at(1))
    decision = decide(Accepted(provider_message_id="ses-0002"), c.state, at(2), RNG)
    assert settle(engine, c, decision, at(2))
    r = row(engine, mid)
    assert r.status == Status.SENT
    assert r.sent_at == at(2)
    assert r.provider_message_id == "ses-0002"
    assert r.claim_token is None
    assert r.lease_expires_at is None
    assert r.attempt_count == 1
    assert r.last_attempt_at == at(1)  # when the send started
    assert r.claimed_by == RELAY
    assert r.updated_at == at(2)
    assert claim(engine, at(10**6)) == []
    assert run(engine, store.sweep_candidates, now=at(10**6)) == []
    # Finalizing twice with the same token does nothing the second time.
    assert not settle(engine, c, decision, at(3))


@pytest.mark.parametrize("status", [Status.PENDING, Status.RETRYING])
def test_a_disabled_provider_release_counts_no_attempt_and_keeps_the_schedule(engine, status):
    mid = make(engine, status)
    before = row(engine, mid)
    now = before.next_attempt_at + timedelta(seconds=1)
    c = claim_one(engine, now)
    mark(engine, [c], now)
    decision = decide(Disabled(code="SendingPaused", message="account paused"), c.state, now, RNG)
    assert decision.action is Action.RELEASE
    assert settle(engine, c, decision, now)
    r = row(engine, mid)
    assert r.status == status
    assert r.attempt_count == before.attempt_count
    assert r.next_attempt_at == before.next_attempt_at
    assert r.last_attempt_at == before.last_attempt_at
    assert r.last_error_code == "SendingPaused"
    assert (r.claim_token, r.lease_expires_at, r.send_started_at) == (None, None, None)
    assert claim_one(engine, now).attempt_count == before.attempt_count


def test_release_unstarted_gives_back_only_the_rows_not_yet_sent(engine):
    ids = enqueue(engine, 3)
    claims = claim(engine, T0)
    assert mark(engine, claims[:1], at(1)) == {ids[0]}
    token = claims[0].claim_token
    assert run(engine, store.release_unstarted, ids=ids, claim_token=token, now=at(2)) == 2
    assert [row(engine, i).status for i in ids] == [
        Status.PROCESSING,
        Status.PENDING,
        Status.PENDING,
    ]
    assert row(engine, ids[1]).claim_token is None
    assert row(engine, ids[1]).attempt_count == 0
    assert row(engine, ids[0]).claim_token == token
    assert run(engine, store.release_unstarted, ids=ids, claim_token=token, now=at(3)) == 0


# -- expiry ------------------------------------------------------------------------------


def test_expired_messages_are_never_claimed(engine):
    (gone,) = enqueue(engine, expires_at=at(30))
    (kept,) = enqueue(engine, expires_at=at(60))
    (plain,) = enqueue(engine)
    claims, expired = run(
        engine, store.claim_batch, relay_id=RELAY, limit=10, now=at(30), lease_seconds=LEASE
    )
    assert [c.id for c in claims] == [kept, plain]
    assert [(e.id, e.category) for e in expired] == [(gone, "default")]
    assert expired[0].key == row(engine, gone).idempotency_key
    r = row(engine, gone)
    assert r.status == Status.EXPIRED
    assert r.claimed_by is None
    assert r.claimed_at is None
    assert r.lease_expires_at is None
    assert r.attempt_count == 0
    assert r.sent_at is None
    assert run(
        engine, store.claim_batch, relay_id=RELAY, limit=10, now=at(10**6), lease_seconds=LEASE
    ) == ([], [])
    # The expired row holds no lease: the sweep sees only the two claimed rows.
    assert {s.claim.id for s in run(engine, store.sweep_candidates, now=at(10**6))} == {kept, plain}


def test_expire_moves_pending_and_retrying_rows_past_their_expiry_even_if_unclaimed(engine):
    (retrying,) = enqueue(engine, expires_at=at(50))
    c = claim_one(engine, T0)
    # Its next attempt would come after its expiry: it is not due when it expires.
    retry = Decision(action=Action.RETRY, next_attempt_at=at(200), code="Throttling")
    assert settle(engine, c, retry, T0)
    (unclaimed,) = enqueue(engine, not_before=at(10), expires_at=at(50))  # never claimed
    (processing,) = enqueue(engine, expires_at=at(50))
    assert claim_one(engine, T0).id == processing
    (later,) = enqueue(engine, expires_at=at(51))
    (forever,) = enqueue(engine)
    assert len(run(engine, store.expire, now=at(49))) == 0
    assert len(run(engine, store.expire, now=at(50))) == 2
    assert row(engine, unclaimed).status == Status.EXPIRED
    assert row(engine, retrying).status == Status.EXPIRED
    assert row(engine, retrying).attempt_count == 1
    # A row being sent is not expired from under its sender, nor are unexpired rows.
    assert row(engine, processing).status == Status.PROCESSING
    assert row(engine, later).status == Status.PENDING
    assert row(engine, forever).status == Status.PENDING
    assert len(run(engine, store.expire, now=at(50))) == 0
    assert row(engine, unclaimed).updated_at == at(50)


# -- order -------------------------------------------------------------------------------


def test_claims_follow_priority_then_due_time_then_id_across_pending_and_retrying(engine):
    (x,) = enqueue(engine, not_before=at(5))
    r_a, r_b = enqueue(engine, 2, not_before=T0)
    claims = claim(engine, T0)
    assert [c.id for c in claims] == [r_a, r_b]
    for c, when in zip(claims, (at(5), at(2)), strict=True):
        assert run(
            engine,
            store.schedule_retry,
            message_id=c.id,
            claim_token=c.claim_token,
            next_attempt_at=when,
            code="Throttling",
            message=None,
            now=T0,
        )
    (y,) = enqueue(engine, not_before=at(5))
    (low,) = enqueue(engine, not_before=at(20), priority=-1)
    (high,) = enqueue(engine, not_before=T0, priority=5)
    (z,) = enqueue(engine, not_before=at(10))
    (later,) = enqueue(engine, not_before=at(100), priority=-5)
    expected = [low, r_b, x, r_a, y, z, high]
    assert {row(engine, i).status for i in (r_a, r_b)} == {Status.RETRYING}

    # A batch takes the first ones in that order, whichever status they are in...
    first = claim(engine, at(50), limit=3)
    assert {c.id for c in first} == set(expected[:3])
    # ...and one at a time, the rest come in exactly that order.
    rest = [claim_one(engine, at(50), limit=1).id for _ in expected[3:]]
    assert rest == expected[3:]
    assert claim(engine, at(50)) == []
    assert [c.id for c in claim(engine, at(100))] == [later]


def test_a_batch_limit_is_filled_from_both_statuses_in_order(engine):
    r_ids = enqueue(engine, 3, not_before=T0)
    for c, second in zip(claim(engine, T0), (1, 3, 5), strict=True):
        assert settle(
            engine,
            c,
            Decision(action=Action.RETRY, next_attempt_at=at(second), code="x"),
            T0,
        )
    p_ids = [enqueue(engine, not_before=at(second))[0] for second in (2, 4, 6)]
    got = claim(engine, at(10), limit=4)
    assert {c.id for c in got} == {r_ids[0], p_ids[0], r_ids[1], p_ids[1]}
    assert {c.id for c in claim(engine, at(10), limit=4)} == {r_ids[2], p_ids[2]}


# -- ambiguity policies ------------------------------------------------------------------


def test_the_hold_policy_parks_an_ambiguous_send_at_once(engine):
    (mid,) = enqueue(engine, category="few")
    c = claim_one(engine, T0)
    mark(engine, [c], at(1))
    decision = decide(Ambiguous(code="ReadTimeout", message="no answer"), c.state, at(2), RNG)
    assert decision.action is Action.HOLD
    assert settle(engine, c, decision, at(2))
    r = row(engine, mid)
    assert (r.status, r.attempt_count) == (Status.UNKNOWN_OUTCOME, 1)
    assert r.send_started_at == at(1)
    assert r.claimed_by == RELAY


def test_the_resend_policy_retries_an_ambiguous_send_and_holds_it_when_exhausted(engine):
    (mid,) = enqueue(engine, category="resend")  # max_attempts 3
    now, actions = T0, []
    for n in range(1, 4):
        c = claim_one(engine, now)
        assert c.attempt_count == n - 1
        mark(engine, [c], now)
        decision = decide(Ambiguous(code="ReadTimeout"), c.state, now, RNG)
        actions.append(decision.action)
        assert settle(engine, c, decision, now)
        r = row(engine, mid)
        assert r.attempt_count == n
        if decision.action is Action.RETRY:
            assert r.status == Status.RETRYING
            assert r.next_attempt_at == decision.next_attempt_at
            now = r.next_attempt_at
    assert actions == [Action.RETRY, Action.RETRY, Action.HOLD]
    r = row(engine, mid)
    assert r.status == Status.UNKNOWN_OUTCOME
    assert r.last_error_code == "ReadTimeout"
    assert claim(engine, at(10**6)) == []


# -- marking, extending, and the sweep guard ---------------------------------------------


def test_mark_send_started_and_extend_lease_only_touch_rows_whose_claim_holds(engine):
    ids = enqueue(engine, 3)
    claims = claim(engine, T0, lease=10)
    token = claims[0].claim_token
    kept = [ids[0], ids[2]]
    assert run(engine, store.extend_lease, ids=kept, claim_token=token, until=at(100)) == set(kept)
    ((lease, decision),) = sweep(engine, at(11))  # ids[1]'s lease ran out, unsent
    assert (lease.claim.id, decision.action) == (ids[1], Action.RELEASE)

    assert run(engine, store.mark_send_started, ids=ids, claim_token=token, now=at(12)) == set(kept)
    assert [row(engine, i).send_started_at for i in ids] == [at(12), None, at(12)]
    assert run(engine, store.extend_lease, ids=ids, claim_token=token, until=at(200)) == set(kept)
    assert [row(engine, i).lease_expires_at for i in ids] == [at(200), None, at(200)]

    # Taken by another relay: the old token stamps and extends nothing of it, even when the
    # new holder stamped and extended it with the very same values.
    other = claim_one(engine, at(13), relay_id="relay-b")
    assert other.id == ids[1]
    assert run(engine, store.mark_send_started, ids=ids, claim_token=token, now=at(14)) == set(kept)
    assert mark(engine, [other], at(14)) == {ids[1]}
    assert run(
        engine, store.extend_lease, ids=[ids[1]], claim_token=other.claim_token, until=at(300)
    ) == {ids[1]}
    assert run(engine, store.mark_send_started, ids=ids, claim_token=token, now=at(14)) == set(kept)
    assert run(engine, store.extend_lease, ids=ids, claim_token=token, until=at(300)) == set(kept)
    r = row(engine, ids[1])
    assert (r.claim_token, r.claimed_by) == (other.claim_token, "relay-b")
    assert run(engine, store.mark_send_started, ids=[], claim_token=token, now=at(14)) == set()
    assert run(engine, store.extend_lease, ids=[], claim_token=token, until=at(14)) == set()


def test_a_finished_row_is_not_marked_or_extended(engine):
    (mid,) = enqueue(engine)
    c = claim_one(engine, T0)
    mark(engine, [c], at(1))
    assert settle(engine, c, decide(Accepted(provider_message_id="p"), c.state, at(2), RNG), at(2))
    token = c.claim_token
    assert run(engine, store.mark_send_started, ids=[mid], claim_token=token, now=at(3)) == set()
    assert run(engine, store.extend_lease, ids=[mid], claim_token=token, until=at(99)) == set()
    assert row(engine, mid).send_started_at == at(1)


@pytest.mark.parametrize(
    ("category", "started", "action"),
    [
        ("default", True, Action.HOLD),
        ("resend", True, Action.RETRY),
        ("default", False, Action.RELEASE),
    ],
)
def test_a_sweep_decision_does_nothing_if_the_owner_extended_the_lease_meanwhile(
    engine, category, started, action
):
    (mid,) = enqueue(engine, category=category)
    c = claim_one(engine, T0, lease=10)
    if started:
        mark(engine, [c], at(1))
    now = at(11)
    with engine.begin() as conn:
        (stale,) = store.sweep_candidates(conn, now=now)
    decision = decide(LeaseExpired(send_started=started), stale.claim.state, now, RNG)
    assert decision.action is action
    # The owner renews its lease between the sweep's read and its update.
    assert run(engine, store.extend_lease, ids=[mid], claim_token=c.claim_token, until=at(40)) == {
        mid
    }
    before = snapshot(engine, mid)
    with engine.begin() as conn:
        assert not store.apply_decision(conn, stale.claim, decision, now, expired_before=now)
    assert snapshot(engine, mid) == before
    assert before["status"] == Status.PROCESSING
    # The owner still holds its claim and finalizes normally.
    assert settle(
        engine, c, decide(Accepted(provider_message_id="p"), c.state, at(12), RNG), at(12)
    )
    assert row(engine, mid).status == Status.SENT


def test_racing_sweeps_that_read_the_same_stale_lease_settle_it_once(engine):
    (mid,) = enqueue(engine, category="resend")
    c = claim_one(engine, T0)
    mark(engine, [c], at(1))
    now = at(LEASE + 1)
    with engine.begin() as conn:
        (seen_by_a,) = store.sweep_candidates(conn, now=now)
        (seen_by_b,) = store.sweep_candidates(conn, now=now)
    decision = decide(LeaseExpired(send_started=True), seen_by_a.claim.state, now, RNG)
    with engine.begin() as conn:
        assert store.apply_decision(conn, seen_by_a.claim, decision, now, expired_before=now)
    with engine.begin() as conn:
        assert not store.apply_decision(conn, seen_by_b.claim, decision, now, expired_before=now)
    assert row(engine, mid).attempt_count == 1
    # A whole sweep run after another finds nothing left to do.
    assert sweep(engine, now) == []
    assert attempt_rows(engine) == []


def test_concurrent_sweeps_move_each_stale_row_once_and_record_it_once(engine):
    ids = enqueue(engine, 4, category="resend")
    claims = claim(engine, T0)
    mark(engine, claims[:2], at(1))  # two sends began, two never did
    now = at(LEASE + 1)
    first, second = sweep(engine, now), sweep(engine, now)
    assert sorted(lease.claim.id for lease, _ in first) == ids
    assert second == []
    assert [row(engine, i).status for i in ids] == [Status.RETRYING] * 2 + [Status.PENDING] * 2
    assert [row(engine, i).attempt_count for i in ids] == [1, 1, 0, 0]
    assert sorted(a.message_id for a in attempt_rows(engine)) == ids[:2]


# -- operator transitions ----------------------------------------------------------------


@pytest.mark.parametrize("status", [Status.UNKNOWN_OUTCOME, Status.FAILED])
def test_requeue_moves_unknown_outcome_and_failed_back_to_pending(engine, status):
    mid = make(engine, status)
    assert row(engine, mid).attempt_count == 1
    assert run(engine, store.requeue, message_id=mid, now=at(500))
    r = row(engine, mid)
    assert r.status == Status.PENDING
    assert r.attempt_count == 0
    assert r.next_attempt_at == at(500)
    assert (r.claim_token, r.lease_expires_at, r.send_started_at) == (None, None, None)
    assert claim(engine, at(499)) == []
    c = claim_one(engine, at(500))
    assert (c.id, c.attempt_count) == (mid, 0)
    assert not run(engine, store.requeue, message_id=mid, now=at(501))


@pytest.mark.parametrize(
    "status",
    [
        Status.PENDING,
        Status.RETRYING,
        Status.PROCESSING,
        Status.SENT,
        Status.CANCELLED,
        Status.EXPIRED,
    ],
)
def test_requeue_is_refused_for_other_statuses(engine, status):
    mid = make(engine, status)
    before = snapshot(engine, mid)
    assert not run(engine, store.requeue, message_id=mid, now=at(500))
    assert snapshot(engine, mid) == before


@pytest.mark.parametrize("status", [Status.PENDING, Status.RETRYING])
def test_cancel_moves_pending_and_retrying_to_cancelled(engine, status):
    mid = make(engine, status)
    assert run(engine, store.cancel, message_id=mid, now=at(500))
    r = row(engine, mid)
    assert r.status == Status.CANCELLED
    assert r.updated_at == at(500)
    assert claim(engine, at(10**6)) == []
    assert not run(engine, store.cancel, message_id=mid, now=at(501))
    assert not run(engine, store.requeue, message_id=mid, now=at(501))


@pytest.mark.parametrize(
    "status",
    [Status.PROCESSING, Status.SENT, Status.FAILED, Status.UNKNOWN_OUTCOME, Status.EXPIRED],
)
def test_cancel_is_refused_for_other_statuses(engine, status):
    mid = make(engine, status)
    before = snapshot(engine, mid)
    assert not run(engine, store.cancel, message_id=mid, now=at(500))
    assert snapshot(engine, mid) == before


def test_operator_transitions_of_a_missing_message_do_nothing(engine):
    assert not run(engine, store.requeue, message_id=424242, now=T0)
    assert not run(engine, store.cancel, message_id=424242, now=T0)


def test_finalize_sent_many_keeps_each_rows_own_guard(engine):
    ids = enqueue(engine, 3)
    claims = claim(engine, T0)
    mark(engine, claims, at(1))
    stale = claims[1]
    sweep(engine, at(LEASE + 10))  # every lease ran out: all three swept to unknown_outcome
    fresh = [c for c in claims if c is not stale]
    with engine.begin() as conn:
        for c in fresh:  # requeue and re-claim two of them under a new token
            assert store.requeue(conn, message_id=c.id, now=at(LEASE + 11))
    reclaimed = claim(engine, at(LEASE + 12))
    assert sorted(c.id for c in reclaimed) == sorted(c.id for c in fresh)
    items = [(c.id, c.claim_token, f"ses-{c.id}") for c in reclaimed]
    items.append((stale.id, stale.claim_token, "ses-stale"))
    moved = run(engine, store.finalize_sent_many, items=items, now=at(LEASE + 13))
    assert moved == {(c.id, c.claim_token) for c in reclaimed}
    assert row(engine, stale.id).status == Status.UNKNOWN_OUTCOME
    assert [row(engine, c.id).provider_message_id for c in reclaimed] == [
        f"ses-{c.id}" for c in reclaimed
    ]
    assert ids


def test_finalize_sent_many_tells_which_claim_of_a_repeated_id_applied(engine):
    """A swept row's late result and its new claim's result can land in one batch: only the
    current claim's applies, and the answer names it by (id, claim token)."""
    (mid,) = enqueue(engine)
    old = claim_one(engine, T0)
    sweep(engine, at(LEASE + 1))  # never marked: back to pending
    new = claim_one(engine, at(LEASE + 2))
    mark(engine, [new], at(LEASE + 3))
    items = [(mid, old.claim_token, "ses-old"), (mid, new.claim_token, "ses-new")]
    moved = run(engine, store.finalize_sent_many, items=items, now=at(LEASE + 4))
    assert moved == {(mid, new.claim_token)}
    assert row(engine, mid).provider_message_id == "ses-new"


def test_the_sent_save_and_its_attempt_rows_are_one_statement_with_stale_ones_marked(engine):
    """``finalize_sent_recorded``: the guarded finalize and the attempt rows together (one
    statement on PostgreSQL); a sent row whose claim is gone is left as it is and its attempt
    recorded ``stale:accepted``, an unguarded record is written as given, in batch order."""
    (a,) = enqueue(engine)
    gone = claim_one(engine, T0)
    sweep(engine, at(LEASE + 1))  # not started: back to pending, its claim gone
    (b,) = enqueue(engine)
    fresh, other = claim(engine, at(LEASE + 2))  # a again, and b, under one new claim
    assert (gone.id, fresh.id, other.id) == (a, a, b)
    mark(engine, [fresh, other], at(LEASE + 3))
    late = at(LEASE + 5)

    def record(claim: store.Claim, outcome: str, provider_id: str | None) -> store.AttemptRecord:
        return store.AttemptRecord(
            message_id=claim.id, claim_token=claim.claim_token, relay_id=RELAY,
            started_at=at(1), finished_at=late, outcome=outcome, provider_message_id=provider_id,
        )  # fmt: skip

    statements: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    with engine.begin() as conn:
        moved = store.finalize_sent_recorded(
            conn,
            [(gone.id, gone.claim_token, "ses-gone"), (fresh.id, fresh.claim_token, "ses-new")],
            [
                (record(gone, "accepted", "ses-gone"), True),
                (record(other, "transient", None), False),  # its decision applied elsewhere
                (record(fresh, "accepted", "ses-new"), True),
            ],
            now=late,
        )
    assert moved == {(fresh.id, fresh.claim_token)}
    if engine.dialect.name == "postgresql":
        assert len(statements) == 1, statements
    assert snapshot(engine, a)["status"] == Status.SENT.value
    assert snapshot(engine, a)["provider_message_id"] == "ses-new"
    assert snapshot(engine, b)["status"] == Status.PROCESSING.value  # not in the finalize
    written = [r for r in attempt_rows(engine) if r.finished_at == late]
    assert [(r.message_id, r.claim_token, r.outcome, r.provider_message_id) for r in written] == [
        (gone.id, gone.claim_token, "stale:accepted", "ses-gone"),
        (other.id, other.claim_token, "transient", None),
        (fresh.id, fresh.claim_token, "accepted", "ses-new"),
    ]
    assert all((r.relay_id, r.started_at) == (RELAY, at(1)) for r in written)


def test_the_last_waves_saves_and_the_next_claims_read_are_one_statement(engine):
    """``save_and_lock``: the sent saves of a wave (one stale) with their attempt rows, and
    the next claim's locking read, one statement on PostgreSQL; the finalize moves only its
    own claim's row, the read takes the due rows, never the ones being saved."""
    first, second, *due = enqueue(engine, 4)
    sent, stale = claim(engine, T0, limit=2)
    mark(engine, [sent, stale], at(1))
    late = at(5)

    def record(c: store.Claim, token: str) -> tuple[store.AttemptRecord, bool]:
        return store.AttemptRecord(
            message_id=c.id, claim_token=token, relay_id=RELAY, started_at=at(1),
            finished_at=late, outcome="accepted", provider_message_id=f"ses-{c.id}",
        ), True  # fmt: skip

    save = store.SentSave(
        [(sent.id, sent.claim_token, f"ses-{sent.id}"), (stale.id, "gone-token", None)],
        [record(sent, sent.claim_token), record(stale, "gone-token")],
        late,
    )
    statements: list[str] = []
    with engine.begin() as conn:
        sa.event.listen(conn, "before_cursor_execute", lambda *a: statements.append(a[2]))
        moved, taking = store.save_and_lock(
            conn, save, relay_id="relay-b", limit=10, now=late, lease_seconds=LEASE
        )
        stamped, _at, _suppressed = store.take_batch(conn, taking, mark=due[:1], now=late)
    assert moved == {(sent.id, sent.claim_token)}
    assert [c.id for c in taking.claims] == due
    assert stamped == {due[0]}
    if engine.dialect.name == "postgresql":
        assert len(statements) == 2, statements  # the save with the read, then the write
    assert (snapshot(engine, first)["status"], snapshot(engine, second)["status"]) == (
        Status.SENT.value,
        Status.PROCESSING.value,  # its claim's token was not the one saved
    )
    assert snapshot(engine, second)["claim_token"] == stale.claim_token
    assert {snapshot(engine, i)["claimed_by"] for i in due} == {"relay-b"}
    written = [(r.message_id, r.outcome) for r in attempt_rows(engine) if r.finished_at == late]
    assert written == [(first, "accepted"), (second, "stale:accepted")]


def _lock(conn: sa.Connection, relay_id: str, limit: int, now: datetime = T0) -> store.Taking:
    return store.lock_batch(conn, relay_id=relay_id, limit=limit, now=now, lease_seconds=LEASE)


def test_a_claim_and_the_mark_of_its_sends_are_one_write_of_each_row(engine):
    """``lock_batch`` then ``take_batch``: the rows end as the claim and the mark leave them,
    the mark on the ones named only; on PostgreSQL each row is written once (the claim's
    lock reads, the take writes), where ``claim_batch`` and the mark wrote marked rows twice."""
    ids = enqueue(engine, 3)
    # the rows this backend has updated and not yet reported (earlier transactions' too)
    updated = sa.text(
        "SELECT coalesce(sum(n_tup_upd), 0) FROM pg_stat_xact_user_tables "
        "WHERE relname = 'outbox_messages'"
    )
    pg = engine.dialect.name == "postgresql"
    with engine.begin() as conn:
        before = conn.execute(updated).scalar_one() if pg else 0
        taking = _lock(conn, RELAY, 10)
        assert [c.id for c in taking.claims] == ids
        assert taking.expired == []
        assert {c.claim_token for c in taking.claims} == {taking.token}
        assert {c.lease_expires_at for c in taking.claims} == {at(LEASE)}
        stamped, stamp, _suppressed = store.take_batch(conn, taking, mark=ids[:2], now=T0)
        if pg:
            assert not taking.written
            assert conn.execute(updated).scalar_one() - before == 3
    assert stamped == set(ids[:2])
    assert stamp >= T0
    for mid in ids:
        got = snapshot(engine, mid)
        assert (got["status"], got["claim_token"], got["claimed_by"]) == (
            Status.PROCESSING.value, taking.token, RELAY,
        )  # fmt: skip
        assert got["lease_expires_at"] == at(LEASE)
        assert got["send_started_at"] == (stamp if mid in ids[:2] else None)


def test_a_claim_read_and_rolled_back_leaves_its_rows_untouched(engine):
    ids = enqueue(engine, 2)
    before = [snapshot(engine, mid) for mid in ids]
    with engine.connect() as conn, conn.begin() as tx:
        taking = _lock(conn, RELAY, 10)
        assert [c.id for c in taking.claims] == ids
        tx.rollback()
    assert [snapshot(engine, mid) for mid in ids] == before
    assert [c.id for c in claim(engine, T0)] == ids  # still there to claim


def test_a_due_row_past_its_expiry_is_expired_by_the_take_and_never_marked(engine):
    (gone,) = enqueue(engine, expires_at=at(1))
    (kept,) = enqueue(engine)
    with engine.begin() as conn:
        taking = _lock(conn, RELAY, 10, now=at(2))
        assert [e.id for e in taking.expired] == [gone]
        assert [c.id for c in taking.claims] == [kept]
        stamped, _stamp, _suppressed = store.take_batch(conn, taking, mark=[gone, kept], now=at(2))
    assert stamped == {kept}
    assert snapshot(engine, gone)["status"] == Status.EXPIRED.value
    assert snapshot(engine, gone)["send_started_at"] is None
    assert snapshot(engine, kept)["status"] == Status.PROCESSING.value


def test_rows_a_claim_has_read_but_not_yet_written_are_skipped_by_another(
    server_backend, racing_engine
):
    """Between ``lock_batch`` and ``take_batch`` the rows are locked: another relay's claim
    skips them (and never waits), and they are this claim's once it commits."""
    ids = enqueue(server_backend.engine, 4)
    with racing_engine.connect() as one, racing_engine.connect() as two:
        held = one.begin()
        taking = _lock(one, "relay-a", 2)
        with two.begin():
            second = _claim_on(two, "relay-b", 10)
        store.take_batch(one, taking, mark=[c.id for c in taking.claims], now=T0)
        held.commit()
    assert [c.id for c in taking.claims] == ids[:2]
    assert [c.id for c in second] == ids[2:]
    _assert_claimed_once(server_backend.engine, taking.claims + second, ids)


def test_the_claims_write_reads_its_rows_by_id_however_stale_the_statistics(postgres_backend):
    """PostgreSQL: ``take_batch`` finds its rows through the primary key, never by scanning
    the backlog. Statistics taken before a backlog came (autovacuum behind a backlog that
    grew fast) made a status guard look like a one-row read of the claim index, and each
    pass read every due row: 12 ms a pass at 20,000, growing with the backlog."""
    engine = postgres_backend.engine
    enqueue(engine, 1000, per_transaction=500)
    with engine.begin() as conn:  # statistics of a table of sent rows: no due row in them
        conn.execute(messages.update().values(status=Status.SENT.value))
        conn.execute(sa.text("ANALYZE outbox_messages"))
    enqueue(engine, 1000, per_transaction=500)  # then a backlog
    with engine.connect() as conn, conn.begin() as tx:
        taking = _lock(conn, RELAY, 10)
        take = store.claims._TAKE_PG.compile(dialect=conn.dialect)
        params = take.construct_params(
            {**taking.params, "c_ids": taking.ids, "c_mark": [], "s_ids": [], "s_addresses": []}
        )
        plan = "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {take}", params))
        tx.rollback()
    assert "pk_outbox_messages" in plan, plan
    assert "ix_outbox_messages_claim" not in plan, plan
