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
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["ACCOUNT", "Admission", "Pauses", "Scope", "ScopeKind"]


class ScopeKind(enum.StrEnum):
    """What a pause stops."""

    ACCOUNT = "account"  # everything this relay sends
    CONFIGURATION_SET = "configuration_set"  # messages sent with one configuration set
    IDENTITY = "identity"  # messages from one sending address or domain


@dataclass(frozen=True, slots=True)
class Scope:
    """One pausable part of sending. ``name`` is the configuration set (empty: the sender's
    default) or the identity (an address or a domain, lower case)."""

    kind: ScopeKind
    name: str = ""

    def __str__(self) -> str:
        return self.kind.value if self.kind is ScopeKind.ACCOUNT else f"{self.kind}:{self.name}"


ACCOUNT = Scope(ScopeKind.ACCOUNT)


class Admission(enum.StrEnum):
    """What to do with a message now."""

    SEND = "send"  # nothing it belongs to is paused
    PROBE = "probe"  # its scope is paused and due a probe: this message is the probe
    HOLD = "hold"  # its scope is paused: give it back, due again when the pause ends


@dataclass(slots=True)
class _Pause:
    code: str
    until: float  # monotonic time of the next probe
    probing: bool = False


class Pauses:
    """The pauses of one relay. Used from the relay's loop thread only."""

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._pauses: dict[Scope, _Pause] = {}

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
        first = scope not in self._pauses
        self._pauses[scope] = _Pause(code=code, until=self._clock() + self.seconds)
        return first

    def paused(self, scope: Scope) -> bool:
        return scope in self._pauses

    def remaining(self, scopes: Iterable[Scope]) -> float:
        """Seconds until the first probe of the paused scopes among ``scopes`` (0 if none)."""
        now = self._clock()
        waits = [max(0.0, self._pauses[s].until - now) for s in scopes if s in self._pauses]
        return max(waits, default=0.0)

    def probe_due(self, scope: Scope = ACCOUNT) -> bool:
        """True if ``scope`` is paused, no probe of it is out, and its probe time has come."""
        pause = self._pauses.get(scope)
        return pause is not None and not pause.probing and self._clock() >= pause.until

    def admit(self, scopes: Iterable[Scope]) -> tuple[Admission, Scope | None]:
        """What to do with a message that belongs to ``scopes``; for a probe, the scope it
        probes (a probe is taken out at once: the next message of that scope is held)."""
        held = [s for s in scopes if s in self._pauses]
        if not held:
            return Admission.SEND, None
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
        return True

    def probe_lost(self, scope: Scope) -> None:
        """The probe was never sent (its claim was lost): probe again after a full period."""
        pause = self._pauses.get(scope)
        if pause is not None:
            pause.probing = False
            pause.until = self._clock() + self.seconds

    def next_probe_in(self) -> float | None:
        """Seconds until the next probe is due (None when nothing waits for one)."""
        now = self._clock()
        waits = [max(0.0, p.until - now) for p in self._pauses.values() if not p.probing]
        return min(waits, default=None)
