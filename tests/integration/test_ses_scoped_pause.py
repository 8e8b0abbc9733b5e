"""A pause has a scope: a paused configuration set, or an identity the credentials may not send
from, holds only its own messages; the rest of the backlog goes on.

Real boto3 through the real ``SesSender`` to moto behind the fault server, which answers
``ConfigurationSetSendingPausedException`` to every send of a paused set and
``AccessDeniedException`` (naming the identity's resource, as SES does) to every send from a
denied identity; the relay runs in this process on each database backend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.schema import attempts
from relay.config import RelayConfig
from relay.pause import ACCOUNT, Scope, ScopeKind, identity
from relay.senders import Disabled, OutgoingMessage
from relay.senders.ses import SesSender, build_client, pause_scope
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
    pause = 1.5
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
