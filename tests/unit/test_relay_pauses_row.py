"""A relay's scoped pauses as its ``outbox_relays`` row holds them: what ``Pauses`` tells of
each pause, the compact JSON written with the heartbeat (bounded however many scopes pause),
and reading it back, where anything malformed is "unreadable", never an exception."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from relay.pause import ACCOUNT, Admission, Pauses, Scope, ScopeKind
from relay.store.relays import (
    PAUSES_CHARS,
    PAUSES_SHOWN,
    PausedScope,
    RelayPauses,
    pauses_text,
    read_pauses,
)
from tests.support.hand_clocks import Monotonic

T0 = datetime(2026, 12, 6, 12, 0, 0, tzinfo=UTC)
PROMO = Scope(ScopeKind.IDENTITY, "promo@example.com")
MARKETING = Scope(ScopeKind.CONFIGURATION_SET, "marketing")


def test_nothing_paused_is_null_and_null_or_empty_reads_as_none():
    assert pauses_text([]) is None
    assert read_pauses(None) == RelayPauses()
    assert read_pauses("") == RelayPauses()
    assert read_pauses(None).count == 0
    assert not read_pauses(None).unreadable


def test_a_pause_is_written_compactly_and_read_back_as_it_was():
    scopes = [
        PausedScope(
            kind="identity",
            name="promo@example.com",
            code="AccessDeniedException",
            since=T0,
            until=T0 + timedelta(seconds=30),
        ),
        PausedScope(
            kind="configuration_set",
            via="shop@example.com",
            code="ConfigurationSetSendingPausedException",
            since=T0 + timedelta(seconds=1),
        ),
    ]
    text = pauses_text(scopes)
    assert text == (
        '{"scopes":[{"kind":"identity","name":"promo@example.com",'
        '"code":"AccessDeniedException","since":"2026-12-06T12:00:00Z",'
        '"until":"2026-12-06T12:00:30Z"},{"kind":"configuration_set","name":"",'
        '"via":"shop@example.com","code":"ConfigurationSetSendingPausedException",'
        '"since":"2026-12-06T12:00:01Z"}]}'
    )
    back = read_pauses(text)
    assert back == RelayPauses(scopes=tuple(scopes))
    assert back.count == 2
    assert back.scopes[0].since is not None
    assert back.scopes[0].since.tzinfo is not None


def test_times_are_written_in_utc_whatever_their_zone():
    east = timezone(timedelta(hours=2))
    text = pauses_text([PausedScope(kind="identity", name="x.example", since=T0.astimezone(east))])
    assert text is not None
    assert '"since":"2026-12-06T12:00:00Z"' in text
    naive = pauses_text([PausedScope(kind="identity", name="x", since=T0.replace(tzinfo=None))])
    assert naive == text.replace("x.example", "x")


def test_a_storm_of_scopes_lists_the_first_hundred_and_counts_the_rest():
    storm = [
        PausedScope(kind="identity", name=f"sender{n}@example.com", code="denied", since=T0)
        for n in range(PAUSES_SHOWN + 250)
    ]
    text = pauses_text(storm)
    assert text is not None
    assert len(text) <= PAUSES_CHARS
    back = read_pauses(text)
    assert [s.name for s in back.scopes] == [s.name for s in storm[:PAUSES_SHOWN]]
    assert back.more == 250
    assert back.count == len(storm)


def test_long_and_foreign_names_are_cut_and_the_value_stays_within_its_bound_in_bytes():
    """Names of 5,000 non-ASCII characters: each cut to 320, escaped to ASCII, and the list
    stops where the next would pass the bound (the rest counted): never near MariaDB's 64 KB
    TEXT, whatever the names."""
    storm = [
        PausedScope(kind="identity", name="\u00e9" * 5000 + f"{n}", via="\u4e2d" * 5000)
        for n in range(PAUSES_SHOWN)
    ]
    text = pauses_text(storm)
    assert text is not None
    assert text.isascii()
    assert len(text.encode()) <= PAUSES_CHARS
    back = read_pauses(text)
    assert 0 < len(back.scopes) < PAUSES_SHOWN
    assert back.count == PAUSES_SHOWN
    assert {len(s.name) for s in back.scopes} == {320}
    assert {s.via for s in back.scopes} == {"\u4e2d" * 320}


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        "null",
        '"scopes"',
        "{}",
        '{"scopes": 5}',
        '{"scopes": [5]}',
        '{"scopes": [{"name": "no kind"}]}',
        '{"scopes": [{"kind": ""}]}',
        '{"scopes": [{"kind": 3}]}',
        '{"scopes": [{"kind": "identity", "name": ["a"]}]}',
        '{"scopes": [{"kind": "identity", "since": "yesterday"}]}',
        '{"scopes": [{"kind": "identity", "until": 1733486400}]}',
        '{"scopes": [{"kind": "identity", "until": "9999-12-31T23:59:59-05:00"}]}',
        '{"scopes": [], "more": -1}',
        '{"scopes": [], "more": true}',
        '{"scopes": [], "more": "3"}',
        '{"scopes": [], "more": 1' + "0" * 5000 + "}",
        "[" * 100_000 + "]" * 100_000,
        '{"scopes": [], "pad": "' + "x" * 70_000 + '"}',
        '{"scopes": [{"kind": "identity", "name": "a"}, {"kind": null}]}',
    ],
)
def test_a_value_this_release_would_not_write_is_unreadable_never_an_exception(text):
    assert read_pauses(text) == RelayPauses(unreadable=True)


def test_what_a_later_release_may_add_is_ignored():
    text = json.dumps(
        {
            "scopes": [{"kind": "tenant", "name": "acme", "weight": 3, "since": "2026-12-06"}],
            "more": 2,
            "version": 2,
        }
    )
    back = read_pauses(text)
    assert not back.unreadable
    assert back.scopes == (PausedScope(kind="tenant", name="acme", since=T0.replace(hour=0)),)
    assert back.count == 3


def test_pauses_tell_their_age_and_next_probe_and_count_the_changes_of_the_set():
    clock = Monotonic(start=1000.0)
    pauses = Pauses(60.0, clock=clock)
    assert pauses.changes == 0
    assert pauses.snapshot() == []

    assert pauses.pause(PROMO, "identity_denied")
    clock.now += 10
    assert pauses.pause(MARKETING, "config_set_paused")
    assert pauses.changes == 2
    clock.now += 5
    (promo, marketing) = pauses.snapshot()
    assert (promo.scope, promo.code, promo.age, promo.probe_in) == (
        PROMO,
        "identity_denied",
        15.0,
        45.0,
    )
    assert (marketing.scope, marketing.age, marketing.probe_in) == (MARKETING, 5.0, 55.0)

    # paused again: the pause keeps the moment it began; the set did not change
    assert not pauses.pause(PROMO, "identity_denied")
    assert pauses.changes == 2
    assert pauses.snapshot()[0].age == 15.0
    assert pauses.snapshot()[0].probe_in == 60.0

    # a probe out: no next probe time; the probe fails: paused on, from the same moment
    clock.now += 60
    message = (ACCOUNT, Scope(ScopeKind.CONFIGURATION_SET, ""), PROMO)
    assert pauses.admit(message) == (Admission.PROBE, PROMO)
    assert pauses.snapshot()[0].probe_in is None
    assert not pauses.probe_ended(PROMO, paused=True)
    assert pauses.snapshot()[0].age == 75.0
    assert pauses.changes == 2

    # the probe goes through: the pause ends, and the set changed
    clock.now += 60
    assert pauses.admit(message) == (Admission.PROBE, PROMO)
    assert pauses.probe_ended(PROMO, paused=False)
    assert [p.scope for p in pauses.snapshot()] == [MARKETING]
    assert pauses.changes == 3
