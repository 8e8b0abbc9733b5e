"""Which sending is paused, and when to probe it again: pure state, with an injected clock.

A provider can stop a whole account (paused, suspended, refused credentials, the daily quota),
one configuration set, or one sending identity. A pause has that scope: an account pause stops
the relay; a scoped pause holds only the messages of its scope, so the rest of the backlog goes
on. Every ``seconds`` one message of a paused scope is let through as a probe; whatever the
probe's outcome, the probe is over: a pausing answer pauses the scope again, anything else ends
the pause (an outcome that says nothing about the provider, such as a lease lost before the
call, lets the next message probe at once).
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from email.utils import getaddresses

__all__ = [
    "ACCOUNT",
    "Admission",
    "Pauses",
    "Scope",
    "ScopeKind",
    "ScopePause",
    "identities",
    "identity",
    "resource_scope",
    "unverified_scope",
]


class ScopeKind(enum.StrEnum):
    """What a pause stops."""

    ACCOUNT = "account"  # everything this relay sends
    CONFIGURATION_SET = "configuration_set"  # messages sent with one configuration set
    IDENTITY = "identity"  # messages from one sending address or domain


@dataclass(frozen=True, slots=True)
class Scope:
    """One pausable part of sending. ``name`` is the configuration set (empty: the sender's
    default) or the identity (an address or a domain, lower case).

    ``via`` (a From address) marks a configuration set that messages reach without naming
    one: a default of the sending identity (or of the relay). Such a scope holds the messages
    from ``via`` that name no configuration set; other senders' mail, and mail from ``via``
    that names its set, goes on."""

    kind: ScopeKind
    name: str = ""
    via: str = ""

    def __str__(self) -> str:
        if self.kind is ScopeKind.ACCOUNT:
            return self.kind.value
        name = self.name or ("(default)" if self.kind is ScopeKind.CONFIGURATION_SET else "")
        return f"{self.kind}:{name}" + (f" via identity:{self.via}" if self.via else "")

    def holds(self, scopes: Collection[Scope]) -> bool:
        """Whether a message that belongs to ``scopes`` is one of this scope's."""
        if not self.via:
            return self in scopes
        return (
            Scope(ScopeKind.CONFIGURATION_SET) in scopes
            and Scope(ScopeKind.IDENTITY, self.via) in scopes
        )


ACCOUNT = Scope(ScopeKind.ACCOUNT)


def identity(sender: str) -> str:
    """The address of a From (``"Shop <Shop@Example.com>"``: ``shop@example.com``), the name
    of its identity scope."""
    return sender.rsplit("<", 1)[-1].rstrip(">").strip().lower()


def identities(sender: str) -> list[str]:
    """The identities a From belongs to, most specific first: its address, its domain and the
    domains above it (a verified domain identity covers its subdomains: SES may name
    ``example.com`` for ``a@mail.example.com``)."""
    address = identity(sender)
    labels = address.rpartition("@")[2].split(".")
    return [address, *(".".join(labels[i:]) for i in range(max(1, len(labels) - 1)))]


# SES: "Email address is not verified. The following identities failed the check in region
# US-EAST-1: Shop <shop@example.com>, someone@example.org" (API and SMTP interface alike)
_FAILED_CHECK = re.compile(r"identities failed the check in region\b[^:]*:(.*)", re.I | re.S)
# an access denial names the resource: "... on resource `arn:aws:ses:...:identity/x'"
_IDENTITY_RESOURCE = re.compile(r":identity/([^\s'`\"]+)")
_CONFIGURATION_SET_RESOURCE = re.compile(r":configuration-set/([^\s'`\"]+)")


def unverified_scope(text: str, sender: str) -> Scope | None:
    """The identity scope of ``sender`` if ``text`` is SES's "identities failed the check"
    refusal naming it (its address or its domain, in any case, with or without a display
    name): the sender is not verified in the region sent to. None if the text names only
    other identities (the SES sandbox's unverified recipients: the message's own problem)."""
    found = _FAILED_CHECK.search(text)
    if found is None or not sender:
        return None
    # the list as RFC 5322 addresses: a display name's commas and an address's quotes
    # (o'brien@) are parsed as such, never taken for a domain of their own
    named = {addr.strip().rstrip(".").lower() for _, addr in getaddresses([found.group(1)])}
    address = identity(sender)
    domain = address.rpartition("@")[2]
    if address in named:
        return Scope(ScopeKind.IDENTITY, address)
    if domain in named:
        return Scope(ScopeKind.IDENTITY, domain)
    return None


def resource_scope(text: str, *, sender: str, configuration_set: str | None) -> Scope | None:
    """The scope an access denial names for a message from ``sender`` that named
    ``configuration_set`` (None: none), or None if it names no resource.

    An identity resource is that identity. A configuration set is the one SES named, by its
    name: for a message that named it, every message naming it; for a message that named
    none, SES used a default (the From identity's, or the relay's ``--configuration-set``),
    so the messages from that From address that name no set (:attr:`Scope.via`)."""
    if found := _IDENTITY_RESOURCE.search(text):
        return Scope(ScopeKind.IDENTITY, found.group(1).lower())
    if found := _CONFIGURATION_SET_RESOURCE.search(text):
        name = found.group(1)
        if configuration_set is not None or not sender:
            return Scope(ScopeKind.CONFIGURATION_SET, name)
        return Scope(ScopeKind.CONFIGURATION_SET, name, via=identity(sender))
    return None


class Admission(enum.StrEnum):
    """What to do with a message now."""

    SEND = "send"  # nothing it belongs to is paused
    PROBE = "probe"  # its scope is paused and due a probe: this message is the probe
    HOLD = "hold"  # its scope is paused: give it back, due again when the pause ends


@dataclass(slots=True)
class _Pause:
    code: str
    until: float  # monotonic time of the next probe
    seen: float  # monotonic time it last held or probed a message (or began)
    began: float  # monotonic time the scope was paused (kept while it is paused again)
    probing: bool = False


@dataclass(frozen=True, slots=True)
class ScopePause:
    """One pause as it stands, for showing (the relay's row in ``outbox_relays``): its scope,
    the provider's code, seconds since it began and until its next probe (None while a
    probe is out)."""

    scope: Scope
    code: str
    age: float
    probe_in: float | None


class Pauses:
    """The pauses of one relay. Used from the relay's loop thread only."""

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._pauses: dict[Scope, _Pause] = {}
        # counts scopes paused and pauses ended: a reader that remembers it knows whether
        # the set of paused scopes changed since (the heartbeat writes it out soon then)
        self.changes = 0

    def __bool__(self) -> bool:
        return bool(self._pauses)

    @property
    def scopes(self) -> list[Scope]:
        return list(self._pauses)

    @property
    def account_paused(self) -> bool:
        return ACCOUNT in self._pauses

    def code(self, scope: Scope = ACCOUNT) -> str | None:
        pause = self._pauses.get(scope)
        return None if pause is None else pause.code

    def codes(self) -> str | None:
        """The codes of every pause, for the relay's state (None when nothing is paused)."""
        if not self._pauses:
            return None
        return ", ".join(f"{scope}={p.code}" for scope, p in self._pauses.items())

    def pause(self, scope: Scope, code: str) -> bool:
        """Pause ``scope`` for ``seconds``; True if it was not paused before."""
        before = self._pauses.get(scope)
        now = self._clock()
        began = now if before is None else before.began
        self._pauses[scope] = _Pause(code=code, until=now + self.seconds, seen=now, began=began)
        if before is None:
            self.changes += 1
        return before is None

    def paused(self, scope: Scope) -> bool:
        return scope in self._pauses

    def remaining(self, scopes: Iterable[Scope]) -> float:
        """Seconds until the first probe of the paused scopes among ``scopes`` (0 if none)."""
        now = self._clock()
        waits = [max(0.0, self._pauses[s].until - now) for s in self._holding(scopes)]
        return max(waits, default=0.0)

    def _holding(self, scopes: Iterable[Scope]) -> list[Scope]:
        """The paused scopes that hold a message of ``scopes``: its own, in its order, then
        the defaults reached through its identity (:attr:`Scope.via`)."""
        mine = tuple(scopes)
        held = [s for s in mine if s in self._pauses]
        return held + [p for p in self._pauses if p.via and p.holds(mine)]

    def probe_due(self, scope: Scope = ACCOUNT) -> bool:
        """True if ``scope`` is paused, no probe of it is out, and its probe time has come."""
        pause = self._pauses.get(scope)
        return pause is not None and not pause.probing and self._clock() >= pause.until

    def overdue(self, scope: Scope) -> float:
        """Seconds since ``scope``'s probe came due with no probe out (0 otherwise)."""
        pause = self._pauses.get(scope)
        if pause is None or pause.probing:
            return 0.0
        return max(0.0, self._clock() - pause.until)

    def idle_for(self, scope: Scope) -> float:
        """Seconds since ``scope``'s pause last held or probed a message (or began)."""
        pause = self._pauses.get(scope)
        return 0.0 if pause is None else max(0.0, self._clock() - pause.seen)

    def admit(self, scopes: Iterable[Scope]) -> tuple[Admission, Scope | None]:
        """What to do with a message that belongs to ``scopes``; for a probe, the scope it
        probes (a probe is taken out at once: the next message of that scope is held)."""
        held = self._holding(scopes)
        if not held:
            return Admission.SEND, None
        now = self._clock()
        for scope in held:
            self._pauses[scope].seen = now
        for scope in held:
            if not self.probe_due(scope):
                return Admission.HOLD, scope
        probe = held[0]
        self._pauses[probe].probing = True
        return Admission.PROBE, probe

    def probe_ended(self, scope: Scope, *, paused: bool, informative: bool = True) -> bool:
        """The probe of ``scope`` came back. ``paused``: the provider still refuses (pause
        again); ``informative=False``: the probe never reached the provider (probe again at
        once). Otherwise the pause is over; returns True then."""
        pause = self._pauses.get(scope)
        if pause is None:
            return False
        if paused:
            pause.probing = False
            pause.until = self._clock() + self.seconds
            return False
        if not informative:
            pause.probing = False
            pause.until = self._clock()
            return False
        del self._pauses[scope]
        self.changes += 1
        return True

    def probe_lost(self, scope: Scope) -> None:
        """The probe was never sent (its claim was lost): probe again after a full period."""
        pause = self._pauses.get(scope)
        if pause is not None:
            pause.probing = False
            pause.until = self._clock() + self.seconds

    def snapshot(self) -> list[ScopePause]:
        """Every pause as it stands, in the order the scopes were paused."""
        now = self._clock()
        return [
            ScopePause(
                scope=scope,
                code=p.code,
                age=max(0.0, now - p.began),
                probe_in=None if p.probing else max(0.0, p.until - now),
            )
            for scope, p in self._pauses.items()
        ]

    def next_probe_in(self) -> float | None:
        """Seconds until the next probe is due (None when nothing waits for one)."""
        now = self._clock()
        waits = [max(0.0, p.until - now) for p in self._pauses.values() if not p.probing]
        return min(waits, default=None)
