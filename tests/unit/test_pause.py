"""relay.pause.Pauses on a clock the test moves: which messages a pause holds, when its probe
goes out, and what each probe outcome does to the pause."""

from __future__ import annotations

import pytest

from relay.pause import ACCOUNT, Admission, Pauses, Scope, ScopeKind
from tests.support.hand_clocks import Monotonic

MARKETING = Scope(ScopeKind.CONFIGURATION_SET, "marketing")
PROMO = Scope(ScopeKind.IDENTITY, "promo@example.com")
DEFAULT_SET = Scope(ScopeKind.CONFIGURATION_SET, "")
SHOP = Scope(ScopeKind.IDENTITY, "shop@example.com")


@pytest.fixture
def clock() -> Monotonic:
    return Monotonic(start=1000.0)


@pytest.fixture
def pauses(clock: Monotonic) -> Pauses:
    return Pauses(60.0, clock=clock)


def marketing_message() -> tuple[Scope, ...]:
    return (ACCOUNT, MARKETING, PROMO, Scope(ScopeKind.IDENTITY, "example.com"))


def ordinary_message() -> tuple[Scope, ...]:
    return (ACCOUNT, DEFAULT_SET, SHOP, Scope(ScopeKind.IDENTITY, "example.com"))


def test_nothing_paused_sends_everything(pauses):
    assert not pauses
    assert pauses.admit(marketing_message()) == (Admission.SEND, None)
    assert pauses.next_probe_in() is None
    assert pauses.codes() is None
    assert not pauses.account_paused


def test_a_scoped_pause_holds_only_its_own_messages(pauses):
    assert pauses.pause(MARKETING, "ConfigurationSetSendingPausedException") is True
    assert pauses
    assert not pauses.account_paused
    assert pauses.admit(marketing_message()) == (Admission.HOLD, MARKETING)
    assert pauses.admit(ordinary_message()) == (Admission.SEND, None)
    assert pauses.code(MARKETING) == "ConfigurationSetSendingPausedException"
    assert pauses.code() is None  # the account is not paused
    assert pauses.codes() == "configuration_set:marketing=ConfigurationSetSendingPausedException"


def test_pausing_again_is_not_a_first_pause_and_restarts_the_period(pauses, clock):
    pauses.pause(ACCOUNT, "AccountSendingPausedException")
    clock.now += 50
    assert pauses.pause(ACCOUNT, "AccountSendingPausedException") is False
    assert pauses.account_paused
    assert pauses.next_probe_in() == pytest.approx(60.0)


def test_one_probe_per_period_and_the_rest_held_while_it_is_out(pauses, clock):
    pauses.pause(MARKETING, "paused")
    clock.now += 59.9
    assert pauses.admit(marketing_message()) == (Admission.HOLD, MARKETING)
    assert pauses.remaining(marketing_message()) == pytest.approx(0.1)
    clock.now += 0.1
    assert pauses.probe_due(MARKETING)
    assert pauses.admit(marketing_message()) == (Admission.PROBE, MARKETING)
    assert not pauses.probe_due(MARKETING)  # the probe is out
    assert pauses.admit(marketing_message()) == (Admission.HOLD, MARKETING)
    assert pauses.next_probe_in() is None  # nothing waits for a probe while one is out
    assert pauses.admit(ordinary_message()) == (Admission.SEND, None)


def test_a_probe_that_is_refused_again_pauses_for_another_period(pauses, clock):
    pauses.pause(MARKETING, "paused")
    clock.now += 60
    pauses.admit(marketing_message())
    clock.now += 1
    assert pauses.probe_ended(MARKETING, paused=True) is False
    assert pauses.paused(MARKETING)
    assert pauses.next_probe_in() == pytest.approx(60.0)
    clock.now += 59
    assert pauses.admit(marketing_message()) == (Admission.HOLD, MARKETING)
    clock.now += 1
    assert pauses.admit(marketing_message()) == (Admission.PROBE, MARKETING)


def test_a_probe_that_says_nothing_lets_the_next_message_probe_at_once(pauses, clock):
    """A non-pausing Disabled (a lease lost before the call, a sender that is switched off
    without a pause) says nothing about the provider: the pause stays, the next probe is due."""
    pauses.pause(ACCOUNT, "AccountSendingPausedException")
    clock.now += 60
    assert pauses.admit(ordinary_message()) == (Admission.PROBE, ACCOUNT)
    assert pauses.probe_ended(ACCOUNT, paused=False, informative=False) is False
    assert pauses.account_paused
    assert pauses.next_probe_in() == 0.0
    assert pauses.admit(ordinary_message()) == (Admission.PROBE, ACCOUNT)


def test_a_probe_that_works_ends_the_pause(pauses, clock):
    pauses.pause(PROMO, "AccessDenied")
    clock.now += 60
    assert pauses.admit(marketing_message()) == (Admission.PROBE, PROMO)
    assert pauses.probe_ended(PROMO, paused=False) is True
    assert not pauses
    assert pauses.admit(marketing_message()) == (Admission.SEND, None)
    assert pauses.probe_ended(PROMO, paused=False) is False  # already over


def test_a_lost_probe_is_tried_again_after_a_full_period(pauses, clock):
    pauses.pause(ACCOUNT, "AccountSendingPausedException")
    clock.now += 60
    pauses.admit(ordinary_message())
    clock.now += 5
    pauses.probe_lost(ACCOUNT)
    assert not pauses.probe_due(ACCOUNT)
    assert pauses.next_probe_in() == pytest.approx(60.0)
    clock.now += 60
    assert pauses.probe_due(ACCOUNT)
    pauses.probe_lost(MARKETING)  # not paused: nothing happens
    assert pauses.scopes == [ACCOUNT]


def test_a_message_in_two_paused_scopes_probes_only_when_both_are_due(pauses, clock):
    pauses.pause(MARKETING, "paused")
    clock.now += 30
    pauses.pause(PROMO, "AccessDenied")
    clock.now += 30  # MARKETING due, PROMO not for another 30 s
    assert pauses.admit(marketing_message()) == (Admission.HOLD, PROMO)
    assert pauses.remaining(marketing_message()) == pytest.approx(30.0)
    assert pauses.next_probe_in() == 0.0
    clock.now += 30
    admission, scope = pauses.admit(marketing_message())
    assert (admission, scope) == (Admission.PROBE, MARKETING)
    assert pauses.next_probe_in() == 0.0  # PROMO is still waiting for its own probe


def test_scope_names_read_well_in_logs():
    assert str(ACCOUNT) == "account"
    assert str(MARKETING) == "configuration_set:marketing"
    assert str(PROMO) == "identity:promo@example.com"


TRACKED_VIA_PROMO = Scope(ScopeKind.CONFIGURATION_SET, "tracked", via="promo@example.com")


def promo_message(configuration_set: str = "") -> tuple[Scope, ...]:
    return (
        ACCOUNT,
        Scope(ScopeKind.CONFIGURATION_SET, configuration_set),
        PROMO,
        Scope(ScopeKind.IDENTITY, "example.com"),
    )


def test_a_default_set_reached_through_an_identity_holds_only_that_identitys_mail(pauses, clock):
    """SES denied ``tracked``, the default set of promo@'s identity: promo@'s messages that
    name no set are held; another sender's, and promo@'s naming a set of their own, go on."""
    pauses.pause(TRACKED_VIA_PROMO, "AccessDenied")
    assert pauses.admit(promo_message()) == (Admission.HOLD, TRACKED_VIA_PROMO)
    assert pauses.admit(ordinary_message()) == (Admission.SEND, None)
    assert pauses.admit(promo_message("marketing")) == (Admission.SEND, None)
    assert pauses.remaining(promo_message()) == pytest.approx(60.0)
    assert pauses.remaining(ordinary_message()) == 0.0
    clock.now += 60
    assert pauses.admit(promo_message()) == (Admission.PROBE, TRACKED_VIA_PROMO)
    assert pauses.probe_ended(TRACKED_VIA_PROMO, paused=False) is True
    assert pauses.admit(promo_message()) == (Admission.SEND, None)


def test_a_default_set_scope_is_named_by_its_set_and_identity():
    assert str(TRACKED_VIA_PROMO) == "configuration_set:tracked via identity:promo@example.com"
    assert Scope(ScopeKind.CONFIGURATION_SET, "tracked") != TRACKED_VIA_PROMO


def test_a_pause_counts_the_time_since_it_last_held_a_message(pauses, clock):
    """What lets the relay end a pause nothing is left to probe, and only such a one:
    holding or probing a message of the scope starts the count again."""
    shop = Scope(ScopeKind.IDENTITY, "shop@example.com")
    pauses.pause(shop, "denied")
    clock.now += 30
    assert pauses.idle_for(shop) == 30
    assert pauses.overdue(shop) == 0  # its probe is not due yet
    assert pauses.admit([ACCOUNT, shop]) == (Admission.HOLD, shop)
    assert pauses.idle_for(shop) == 0
    clock.now += 100
    assert pauses.overdue(shop) == 70
    assert pauses.admit([ACCOUNT, shop]) == (Admission.PROBE, shop)
    assert pauses.overdue(shop) == 0  # a probe is out
    assert pauses.idle_for(shop) == 0
    assert pauses.idle_for(Scope(ScopeKind.IDENTITY, "other@example.com")) == 0  # not paused
