"""What the loop does about pauses: react to outcomes, pause, end pauses nothing probes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

import sqlalchemy as sa

from outbox.message import Email
from relay import store
from relay.config import RelayConfig
from relay.pause import ACCOUNT, Pauses, Scope, ScopeKind, identities
from relay.ratelimit import RateController
from relay.senders import Ambiguous, Disabled, Outcome, Permanent, Transient

__all__ = ["PauseControl", "scopes"]

_log = logging.getLogger("relay")

_SENDER_ERRORS_TO_PAUSE = 3  # consecutive sends the sender raised on: pause, do not burn the queue


def scopes(email: Email) -> tuple[Scope, ...]:
    """The pausable scopes a message belongs to: the account, its configuration set (empty:
    the sender's default), its From address, its domain and the domains above it."""
    return (
        ACCOUNT,
        Scope(ScopeKind.CONFIGURATION_SET, email.configuration_set or ""),
        *(Scope(ScopeKind.IDENTITY, name) for name in identities(email.sender)),
    )


class PauseControl:
    """Turns outcomes into pauses and resumptions; ``on_account(paused)`` tells the loop the
    account's state changed, ``release(scope)`` gives back the unstarted claims a pause holds
    (None: all of them)."""

    def __init__(
        self,
        pauses: Pauses,
        config: RelayConfig,
        rate: RateController,
        *,
        on_account: Callable[[bool], None],
        release: Callable[[Scope | None], None],
    ) -> None:
        self.pauses = pauses
        self.config = config
        self.rate = rate
        self._on_account = on_account
        self._release = release
        self._sender_errors = 0  # consecutive sends the sender raised on

    def react(self, outcome: Outcome, probe: Scope | None) -> None:
        """Adapt to what the provider said: slow down, pause, resume. Whatever a probe's
        outcome, the probe is over."""
        match outcome:
            case Transient(throttled=True):
                self.rate.on_throttle()
            case Disabled(pause=True, code=code, scope=scope):
                self.pause(scope, code)
            case Permanent(config_error=True, code=code):
                _log.error(
                    "sending is misconfigured: %s",
                    code,
                    extra={"action": "config_error", "code": code},
                )
        broken = isinstance(outcome, Ambiguous) and outcome.code == "sender_exception"
        self._sender_errors = self._sender_errors + 1 if broken else 0
        if self._sender_errors >= _SENDER_ERRORS_TO_PAUSE:
            self.pause(ACCOUNT, "sender_exception")
        if probe is None:
            return
        still = (isinstance(outcome, Disabled) and outcome.pause) or (broken and probe == ACCOUNT)
        if self.pauses.probe_ended(
            probe, paused=still, informative=not isinstance(outcome, Disabled) or still
        ):
            if probe == ACCOUNT:
                self._on_account(False)
            _log.warning(
                "sending works again; resuming (%s)",
                probe,
                extra={"action": "resumed", "scope": str(probe)},
            )

    def pause(self, scope: Scope, code: str) -> None:
        first = self.pauses.pause(scope, code)
        _log.error(
            "sending paused (%s: %s); probing again in %gs",
            scope,
            code,
            self.config.pause_seconds,
            extra={
                "action": "paused" if first else "still_paused",
                "code": code,
                "scope": str(scope),
            },
        )
        if scope == ACCOUNT:
            self._on_account(True)
            self._release(None)
        else:
            self._release(scope)

    def due_to_end(self) -> list[Scope]:
        """Scoped pauses past their probe time that have held no message for longer than a
        pause: whatever they held has been due again since, and was not claimed."""
        grace = max(1.0, 2 * self.config.poll_interval)
        return [
            s
            for s in self.pauses.scopes
            if s != ACCOUNT
            and self.pauses.overdue(s) > grace
            and self.pauses.idle_for(s) > self.pauses.seconds + grace
        ]

    def unheld(self, conn: sa.Connection, due: list[Scope], now: datetime) -> list[Scope]:
        """Of the pauses ``due`` to end, those no other relay may be holding mail of: all of
        them while this relay runs alone; beside others (each skips what another locked),
        only those idle for ten pause periods, at least ten minutes (docs/design.md,
        Decisions: "Pauses have a scope")."""
        since = now - timedelta(seconds=3 * self.config.heartbeat_interval)
        running, _ = store.live_heartbeats(conn, since=since)
        if running <= 1:
            return due
        patience = max(600.0, 10 * self.pauses.seconds)
        return [s for s in due if self.pauses.idle_for(s) > patience]

    def retire_unprobed(self, due: list[Scope]) -> None:
        """End the pauses due a probe before a claim that took every due message and found
        none of theirs: a pause nothing can probe would never end; a later refused message
        pauses its scope again."""
        for scope in due:
            if self.pauses.probe_due(scope):  # no message of it became the probe
                self.pauses.probe_ended(scope, paused=False)
                _log.warning(
                    "no message of %s is due: its pause ends",
                    scope,
                    extra={"action": "resumed", "scope": str(scope)},
                )
