"""Senders deliver one message and say what happened, as a typed :data:`Outcome`.

A sender never raises for a delivery problem: it classifies it. The classification is what
keeps the relay's promises, so the rule is strict: if a request *may* have reached the
provider and no answer came back, the outcome is :class:`Ambiguous`, never :class:`Transient`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from outbox.message import Email
from relay.pause import ACCOUNT, Scope

__all__ = [
    "Accepted",
    "Ambiguous",
    "Disabled",
    "Outcome",
    "OutgoingMessage",
    "Permanent",
    "Sender",
    "Transient",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class OutgoingMessage:
    """What a sender gets: the email and the row it came from (for tags and logs)."""

    id: int
    key: str
    category: str
    attempt: int  # 1 for the first attempt
    email: Email


@dataclass(frozen=True, kw_only=True, slots=True)
class Accepted:
    """The provider accepted the message.

    ``refused`` lists the recipients it refused for good while taking the message for the
    others (SMTP answers per recipient), each as ``"address: reply"``: they did not get it."""

    provider_message_id: str | None
    refused: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Transient:
    """The provider did not take the message and said so; trying again later may work.

    ``throttled`` marks a rate-limit answer; ``retry_after`` (seconds) is a floor for the delay.
    """

    code: str
    message: str = ""
    throttled: bool = False
    retry_after: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Permanent:
    """The provider refused the message; sending it again would fail the same way.

    ``config_error`` marks a refusal caused by the sending setup (an unverified MAIL FROM
    domain, a missing configuration set): logged at error level, since every message will
    fail the same way until someone fixes it."""

    code: str
    message: str = ""
    config_error: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Ambiguous:
    """The request may have reached the provider, but no answer came back."""

    code: str
    message: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Disabled:
    """The sender cannot send now for a reason that is not this message's fault (sending
    disabled or paused); the message goes back untouched, no attempt counted.

    With ``pause`` sending pauses for ``scope``: the whole account (paused or suspended,
    credentials refused, the daily quota used up: the relay stops claiming and gives back what
    it holds), or one configuration set or sending identity (only its messages are held, the
    rest go on). One probe message of the scope is sent every ``--pause-seconds`` to see
    whether sending works again."""

    code: str
    message: str = ""
    pause: bool = False
    scope: Scope = ACCOUNT


Outcome = Accepted | Transient | Permanent | Ambiguous | Disabled


@runtime_checkable
class Sender(Protocol):
    """Delivers one message. Called from worker threads: must be thread-safe."""

    name: str

    def send(self, message: OutgoingMessage) -> Outcome:
        """Deliver ``message`` and classify what happened. Must not raise for delivery errors."""
        ...
