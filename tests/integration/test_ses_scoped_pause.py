"""A pause has a scope: a paused configuration set, or an identity the credentials may not send
from, holds only its own messages; the rest of the backlog goes on.

Real boto3 through the real ``SesSender`` to moto behind the fault server, which answers
``ConfigurationSetSendingPausedException`` to every send of a paused set and
``AccessDeniedException`` (naming the identity's resource, as SES does) to every send from a
denied identity; the relay runs in this process on each database backend.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.schema import attempts, messages, relays
from relay.config import RelayConfig
from relay.pause import ACCOUNT, Scope, ScopeKind, identity
from relay.senders import Accepted, Disabled, OutgoingMessage
from relay.senders.ses import SesSender, build_client, pause_scope
from relay.testing import FakeSender
from relay.worker import Relay
from tests.support import ses as ses_support
from tests.support.factories import email, enqueue
from tests.support.relays import message_rows
from tests.support.ses import FaultPlan, FaultServer, aws_env
from tests.support.waiting import wait_for

PAUSE = 0.6  # --pause-seconds


@pytest.fixture
def ses(moto, monkeypatch):
    moto.verify("shop@example.com")
    moto.verify("promo@example.com")
    with FaultServer(moto.url) as server:
        for name, value in aws_env(server.url).items():
            monkeypatch.setenv(name, value)
        yield server


def run_relay(backend, *, timeout: float = 20.0) -> Relay:
    """Run a relay with the real SES sender until it is idle; fail (not hang) past ``timeout``."""
    config = RelayConfig(
        database_url=backend.url,
        sender="ses",
        relay_id="scoped",
        poll_interval=0.05,
        send_timeout=5.0,
        lease_seconds=15.0,
        drain_seconds=5.0,
        pause_seconds=PAUSE,
        exit_when_idle=True,
    )
    sender = SesSender(build_client(send_timeout=5.0, concurrency=8))
    relay = Relay(engine=backend.engine, sender=sender, config=config)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        relay.request_stop()
        thread.join(10)
        pytest.fail(f"the relay did not finish within {timeout}s")
    return relay


def requests_per_message(ses: FaultServer) -> Counter[int | None]:
    return Counter(s.outbox_id for s in ses.sends)


@pytest.mark.parametrize(
    ("code", "text", "configuration_set", "scope"),
    [
        (
            "ConfigurationSetSendingPausedException",
            "",
            "marketing",
            ("configuration_set", "marketing"),
        ),
        ("ConfigurationSetSendingPausedException", "", None, ("configuration_set", "")),
        (
            "AccessDeniedException",
            "not authorized to perform `ses:SendEmail' on resource "
            "`arn:aws:ses:eu-west-1:1:identity/Promo@Example.com'",
            None,
            ("identity", "promo@example.com"),
        ),
        (
            "AccessDeniedException",
            "on resource `arn:aws:ses:eu-west-1:1:configuration-set/marketing'",
            "marketing",
            ("configuration_set", "marketing"),
        ),
        ("AccessDeniedException", "User is not authorized", None, ("account", "")),
        ("AccountSendingPausedException", "", "marketing", ("account", "")),
        ("DailyQuotaExceeded", "", None, ("account", "")),
    ],
)
def test_pause_scope_reads_what_the_answer_stops(code, text, configuration_set, scope):
    assert pause_scope(code, text, configuration_set) == Scope(ScopeKind(scope[0]), scope[1])


def test_a_paused_configuration_set_answer_is_a_scoped_pause(ses):
    ses.plan.paused_sets.add("marketing")
    sender = SesSender(build_client(send_timeout=5.0, concurrency=1))
    outcome = sender.send(
        OutgoingMessage(
            id=1,
            key="k",
            category="default",
            attempt=1,
            email=email(1, short=True, configuration_set="marketing"),
        )
    )
    assert isinstance(outcome, Disabled)
    assert outcome.pause
    assert outcome.scope == Scope(ScopeKind.CONFIGURATION_SET, "marketing")
    assert outcome.scope != ACCOUNT


def test_a_paused_configuration_set_holds_only_its_own_mail(backend, ses):
    """20 messages, one in a paused configuration set: the other 19 are delivered, the paused
    one is tried once and steps back in line (no attempt used); once the set works again it
    is delivered, once."""
    ses.plan.paused_sets.add("marketing")
    ids = enqueue(
        backend.engine,
        [
            email(n, short=True, configuration_set="marketing" if n == 0 else None)
            for n in range(20)
        ],
    )
    paused_id = ids[0]

    began = time.monotonic()
    relay = run_relay(backend)
    took = time.monotonic() - began

    got = message_rows(backend.engine)
    assert {i for i in ids if got[i].status == "sent"} == set(ids[1:]), {
        i: (got[i].status, got[i].last_error_code, got[i].last_error_message) for i in ids
    }
    held = got[paused_id]
    assert (held.status, held.attempt_count) == ("pending", 0)
    assert held.next_attempt_at > held.created_at  # moved back in line until its probe
    # tried once, then at most one probe per pause period
    assert 1 <= requests_per_message(ses)[paused_id] <= 1 + took / PAUSE
    assert not relay.paused  # the account was never paused

    ses.plan.paused_sets.clear()
    time.sleep(PAUSE + 0.3)  # until its probe is due
    run_relay(backend)

    final = message_rows(backend.engine)[paused_id]
    assert final.status == "sent"
    accepted = [s for s in ses.sends if s.outbox_id == paused_id and s.accepted]
    assert [s.message_id for s in accepted] == [final.provider_message_id]
    assert sum(1 for s in ses.sends if s.accepted) == 20


def test_a_denied_identity_holds_only_its_own_mail(backend, ses):
    ses.plan.denied_identities.add("promo@example.com")
    promo = [email(n, short=True, sender="Promo <promo@example.com>") for n in range(3)]
    ids = enqueue(backend.engine, promo + [email(n, short=True) for n in range(3, 10)])

    began = time.monotonic()
    run_relay(backend)
    took = time.monotonic() - began

    got = message_rows(backend.engine)
    assert {i for i in ids if got[i].status == "sent"} == set(ids[3:])
    assert all(got[i].status == "pending" and got[i].attempt_count == 0 for i in ids[:3])
    with backend.engine.connect() as conn:
        codes = Counter(
            conn.execute(
                sa.select(attempts.c.error_code).where(attempts.c.message_id.in_(ids[:3]))
            ).scalars()
        )
    # each promo message tried at most once before the scope was known to be paused, then
    # one probe per pause period
    assert sum(requests_per_message(ses)[i] for i in ids[:3]) <= 3 + took / PAUSE
    assert set(codes) <= {"AccessDeniedException"}


# -- an unverified sending identity (issue 27, item 2) -------------------------------------

NOT_VERIFIED = (
    400,
    "MessageRejected",
    "Email address is not verified. The following identities failed the check in region "
    "US-EAST-1: Promo <{identity}>",
)


class UnverifiedPlan(FaultPlan):
    """Answers SES's own "not verified" refusal, naming the From, to every send from an
    address in ``unverified`` (the identity missing in the region, or AWS_REGION wrong)."""

    def __init__(self) -> None:
        super().__init__()
        self.unverified: set[str] = set()

    def scoped(self, request: dict[str, Any]) -> tuple[str, str] | None:
        sender = identity(str(request.get("FromEmailAddress", "")))
        if sender in self.unverified:
            return "not_verified", sender
        return super().scoped(request)


def test_an_unverified_sender_holds_only_its_own_mail_until_it_works(
    backend, moto, monkeypatch, caplog
):
    """Three messages from promo@, unverified, among twenty from shop@: shop@'s go out at
    once, each in one request, while promo@'s are held (pending, no attempt used) and logged
    at error level as a paused identity, not failed; once promo@ is verified, the relay's
    probe finds out and every held message goes out, once."""
    monkeypatch.setitem(ses_support.ERRORS, "not_verified", NOT_VERIFIED)
    # moto compares addresses case-sensitively (Email lower-cases only the domain)
    moto.verify("Promo@example.com")
    plan = UnverifiedPlan()
    plan.unverified.add("promo@example.com")
    pause = 3.0  # long enough that a loaded machine's slow sends do not look like waiting
    with FaultServer(moto.url, plan) as server:
        for name, value in aws_env(server.url).items():
            monkeypatch.setenv(name, value)
        promo = [email(n, short=True, sender="Promo <Promo@Example.com>") for n in range(3)]
        ids = enqueue(backend.engine, promo + [email(n, short=True) for n in range(3, 23)])
        promo_ids, shop_ids = ids[:3], ids[3:]
        config = RelayConfig(
            database_url=backend.url,
            sender="ses",
            relay_id="unverified",
            poll_interval=0.05,
            send_timeout=5.0,
            lease_seconds=15.0,
            drain_seconds=5.0,
            pause_seconds=pause,
        )
        sender = SesSender(build_client(send_timeout=5.0, concurrency=8))
        relay = Relay(engine=backend.engine, sender=sender, config=config)
        caplog.set_level(logging.ERROR, logger="relay")
        thread = threading.Thread(target=relay.run, daemon=True)
        thread.start()
        try:
            wait_for(
                lambda: (
                    all(message_rows(backend.engine)[i].status == "sent" for i in shop_ids)
                    and all(requests_per_message(server)[i] for i in promo_ids)
                ),
                timeout=20,
            )
            got = message_rows(backend.engine)
            assert all((got[i].status, got[i].attempt_count) == ("pending", 0) for i in promo_ids)
            assert not relay.paused  # the account never was: shop@'s mail went on
            assert all(requests_per_message(server)[i] == 1 for i in shop_ids)
            first_refusal = min(s.at for s in server.sends if s.outbox_id in promo_ids)
            last_shop = max(s.at for s in server.sends if s.outbox_id in shop_ids)
            assert last_shop < first_refusal + pause  # none of shop@'s waited for the pause
            paused = [r for r in caplog.records if getattr(r, "action", None) == "paused"]
            assert [(r.levelno, r.scope) for r in paused] == [
                (logging.ERROR, "identity:promo@example.com")
            ]

            plan.unverified.clear()  # promo@ verified: the next probe finds it works
            wait_for(
                lambda: all(message_rows(backend.engine)[i].status == "sent" for i in promo_ids),
                timeout=20,
            )
        finally:
            relay.request_stop()
            thread.join(15)
        assert not thread.is_alive()

    final = message_rows(backend.engine)
    assert all(final[i].status == "sent" for i in ids)
    assert server.accepted_per_message() == Counter(dict.fromkeys(ids, 1))
    refused = [s for s in server.sends if s.kind == "not_verified"]
    assert {s.outbox_id for s in refused} <= set(promo_ids)
    with backend.engine.connect() as conn:
        codes = set(
            conn.execute(
                sa.select(attempts.c.error_code).where(attempts.c.message_id.in_(promo_ids))
            ).scalars()
        )
    assert codes <= {"MessageRejected", None}


# -- the second attack review (issue 27) -----------------------------------------------------


class DefaultSetPlan(FaultPlan):
    """Sending paused in the default configuration set of the identities in ``paused_defaults``:
    SES refuses their mail that names no set (``ConfigurationSetSendingPausedException``)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused_defaults: set[str] = set()

    def scoped(self, request: dict[str, Any]) -> tuple[str, str] | None:
        sender = identity(str(request.get("FromEmailAddress", "")))
        if not request.get("ConfigurationSetName") and sender in self.paused_defaults:
            return "config_set_paused", ""
        return super().scoped(request)


def relay_thread(backend, *, relay_id: str, pause: float, poll: float = 0.05) -> Relay:
    config = RelayConfig(
        database_url=backend.url,
        sender="ses",
        relay_id=relay_id,
        poll_interval=poll,
        send_timeout=5.0,
        lease_seconds=15.0,
        drain_seconds=5.0,
        pause_seconds=pause,
    )
    sender = SesSender(build_client(send_timeout=5.0, concurrency=8))
    return Relay(engine=backend.engine, sender=sender, config=config)


@contextlib.contextmanager
def running(relay: Relay):
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        relay.request_stop()
        thread.join(15)
    assert not thread.is_alive()


def test_a_paused_default_set_of_one_sender_holds_only_that_senders_mail(
    backend, moto, monkeypatch
):
    """promo@'s default configuration set is paused and no message names a set: promo@'s
    mail is held (through its identity), shop@'s goes out at once, none of it waiting for the
    pause (it held every message without a set before)."""
    moto.verify("shop@example.com")
    moto.verify("promo@example.com")
    plan = DefaultSetPlan()
    plan.paused_defaults.add("promo@example.com")
    # long enough that mail held for the pause and mail merely slowed by a loaded machine
    # fall on opposite sides of pause / 2
    pause = 6.0
    with FaultServer(moto.url, plan) as server:
        for name, value in aws_env(server.url).items():
            monkeypatch.setenv(name, value)
        promo = [email(n, short=True, sender="promo@example.com") for n in range(2)]
        ids = enqueue(backend.engine, promo + [email(n, short=True) for n in range(2, 22)])
        promo_ids, shop_ids = ids[:2], ids[2:]
        relay = relay_thread(backend, relay_id="default-set", pause=pause)
        with running(relay):
            wait_for(
                lambda: all(message_rows(backend.engine)[i].status == "sent" for i in shop_ids),
                timeout=20,
            )
            assert relay.pauses.scopes == [
                Scope(ScopeKind.CONFIGURATION_SET, via="promo@example.com")
            ]
        got = message_rows(backend.engine)
        assert all((got[i].status, got[i].attempt_count) == ("pending", 0) for i in promo_ids)
        first_refusal = min(s.at for s in server.sends if s.outbox_id in promo_ids)
        last_shop = max(s.at for s in server.sends if s.outbox_id in shop_ids)
        assert last_shop < first_refusal + pause / 2, "shop@'s mail waited for promo@'s pause"
        assert all(requests_per_message(server)[i] == 1 for i in shop_ids)


class ParentDomainPlan(FaultPlan):
    """SES denies the domain identity example.com, and names it, for mail from its
    subdomains."""

    def scoped(self, request: dict[str, Any]) -> tuple[str, str] | None:
        sender = identity(str(request.get("FromEmailAddress", "")))
        if sender.endswith("@mail.example.com"):
            return "identity_denied", "example.com"
        return super().scoped(request)


def test_a_pause_with_nothing_left_to_probe_ends_and_the_loop_keeps_its_pace(
    backend, moto, monkeypatch
):
    """SES names example.com for a@mail.example.com: the pause holds that mail (the parent
    domain is one of its scopes, so it is not re-sent each period). Once the mail expired
    there is nothing to probe with: the pause ends, and meanwhile the loop waits its poll
    interval (it spun every 5 ms, ~170 transactions a second)."""
    moto.verify("shop@example.com")
    with FaultServer(moto.url, ParentDomainPlan()) as server:
        for name, value in aws_env(server.url).items():
            monkeypatch.setenv(name, value)
        expires = datetime.now(UTC) + timedelta(seconds=2.5)
        ids = enqueue(
            backend.engine, 3, short=True, sender="a@mail.example.com", expires_at=expires
        )
        transactions = Counter[str]()

        def count(conn: sa.Connection) -> None:
            transactions.update(["begin"])

        sa.event.listen(backend.engine, "begin", count)
        relay = relay_thread(backend, relay_id="orphan-pause", pause=0.6, poll=0.25)
        reader = sa.create_engine(backend.url)  # the test's reads are not the relay's
        began = time.monotonic()
        with running(relay):
            wait_for(lambda: bool(relay.pauses.scopes), timeout=10)
            assert relay.pauses.scopes == [Scope(ScopeKind.IDENTITY, "example.com")]
            wait_for(
                lambda: all(message_rows(reader)[i].status == "expired" for i in ids),
                timeout=15,
            )
            wait_for(lambda: not relay.pauses.scopes, timeout=10)
            time.sleep(1.0)
        took = time.monotonic() - began
        sa.event.remove(backend.engine, "begin", count)
        reader.dispose()
    # held after the first refusal: one request, then one probe per pause period at most
    assert sum(requests_per_message(server)[i] for i in ids) <= 1 + took / 0.6
    assert transactions["begin"] < 25 * took, (transactions, took)


@pytest.mark.parametrize(
    ("code", "configuration_set", "relay_default", "scope"),
    [
        # the From identity's own default set: only that From's mail naming no set
        (
            "ConfigurationSetSendingPausedException",
            None,
            None,
            Scope(ScopeKind.CONFIGURATION_SET, via="promo@example.com"),
        ),
        # the relay's --ses-configuration-set: every message naming no set goes through it
        (
            "ConfigurationSetSendingPausedException",
            None,
            "relay-set",
            Scope(ScopeKind.CONFIGURATION_SET),
        ),
        (
            "AccessDenied",
            None,
            "relay-set",
            Scope(ScopeKind.CONFIGURATION_SET),
        ),
        (
            "ConfigurationSetSendingPausedException",
            "marketing",
            "relay-set",
            Scope(ScopeKind.CONFIGURATION_SET, "marketing"),
        ),
    ],
)
def test_a_paused_set_a_message_did_not_name_is_the_default_it_went_through(
    code, configuration_set, relay_default, scope
):
    text = "on resource `arn:aws:ses:eu-west-1:1:configuration-set/relay-set'"
    found = pause_scope(
        code,
        text,
        configuration_set,
        sender="Promo <promo@example.com>",
        relay_default=relay_default,
    )
    assert found == scope
    assert str(Scope(ScopeKind.CONFIGURATION_SET)) == "configuration_set:(default)"


def test_a_pause_that_still_holds_mail_is_not_ended_by_a_claim_cut_short_by_expired_rows(
    backend,
):
    """A paused sender's held mail sits behind a backlog whose rows partly expire: a claim
    that meets them returns fewer rows than its limit though due rows remain. The pause must
    not take that for "nothing of mine is left" (it ended, and the held mail went out in one
    burst into the paused identity): after the first wave, one probe per pause period."""
    now = datetime.now(UTC)
    ids = enqueue(backend.engine, [email(n, short=True, sender="bad@x.example") for n in range(8)])
    for n in range(8, 88, 2):  # every other one of the backlog expires while it is sent
        enqueue(backend.engine, [email(n, short=True)])
        enqueue(backend.engine, [email(n + 1, short=True)], expires_at=now + timedelta(seconds=2))
    denied = Scope(ScopeKind.IDENTITY, "bad@x.example")
    began = time.monotonic()
    tried: list[float] = []

    def answer(m: OutgoingMessage):
        if m.email.sender == "bad@x.example":
            tried.append(time.monotonic() - began)
            return Disabled(code="identity_denied", pause=True, scope=denied)
        time.sleep(0.2)
        return Accepted(provider_message_id=f"p{m.id}")

    config = RelayConfig(
        database_url=backend.url,
        sender="fake",
        relay_id="cut-short",
        poll_interval=0.1,
        pause_seconds=1.0,
        send_timeout=2.0,
        lease_seconds=10.0,
        drain_seconds=2.0,
        concurrency=4,
        batch_size=4,
    )
    relay = Relay(engine=backend.engine, sender=FakeSender(answer), config=config)
    with running(relay):
        time.sleep(6.0)
        assert relay.pauses.paused(denied)
    first_wave = [t for t in tried if t < 0.5]
    later = sorted(t for t in tried if t >= 0.5)
    gaps = [b - a for a, b in itertools.pairwise(later)]
    assert first_wave, tried
    assert all(gap > 0.6 for gap in gaps), f"a burst into the paused identity: {tried}"
    got = message_rows(backend.engine)
    assert all(got[i].status == "pending" and got[i].attempt_count == 0 for i in ids)


def test_a_pause_is_kept_while_another_live_relay_may_hold_its_mail(server_backend):
    """Another replica (a live row in outbox_relays) holds the paused sender's rows (locked:
    this relay's claim skips them and finds none of its mail). Alone, that would end the
    pause; beside a live relay it must not, or this relay sends that mail in one burst into
    the paused identity the moment the other lets go."""
    backend = server_backend
    denied = Scope(ScopeKind.IDENTITY, "bad@x.example")
    held = enqueue(backend.engine, [email(n, short=True, sender="bad@x.example") for n in range(3)])
    tried: list[int] = []

    def answer(m: OutgoingMessage):
        tried.append(m.id)
        return Disabled(code="identity_denied", pause=True, scope=denied)

    config = RelayConfig(
        database_url=backend.url,
        sender="fake",
        relay_id="this-one",
        poll_interval=0.05,
        pause_seconds=0.3,
        send_timeout=2.0,
        lease_seconds=10.0,
        drain_seconds=2.0,
    )
    relay = Relay(engine=backend.engine, sender=FakeSender(answer), config=config)
    with running(relay):
        wait_for(lambda: relay.pauses.paused(denied), timeout=10)
        with backend.engine.connect() as other:  # the other replica, alive, holding the rows
            other.execute(
                sa.insert(relays).values(
                    relay_id="the-other",
                    host="elsewhere",
                    pid=1,
                    started_at=sa.func.now(),
                    heartbeat_at=sa.func.now(),
                    state="running",
                )
            )
            other.commit()
            other.execute(
                sa.select(messages.c.id).where(messages.c.id.in_(held)).with_for_update()
            ).all()
            before = len(tried)
            for _ in range(30):  # 3 s: ten times the pause, seven times the grace
                time.sleep(0.1)
                with backend.engine.begin() as beat:
                    beat.execute(
                        sa.update(relays)
                        .where(relays.c.relay_id == "the-other")
                        .values(heartbeat_at=sa.func.now())
                    )
            assert relay.pauses.paused(denied), "ended while another relay held its mail"
            assert len(tried) == before  # nothing of it could be claimed meanwhile
            other.rollback()
        wait_for(lambda: len(tried) > before, timeout=10)  # let go: probed, once a period
        time.sleep(1.0)
    first = tried[before:]
    assert len(first) <= 1 + 1.0 / 0.3 + 1, f"a burst into the paused identity: {first}"
