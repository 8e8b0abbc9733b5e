"""Senders deliver one message and say what happened, as a typed :data:`Outcome`.

A sender never raises for a delivery problem: it classifies it. The classification is what
keeps the relay's promises, so the rule is strict: if a request *may* have reached the
provider and no answer came back, the outcome is :class:`Ambiguous`, never :class:`Transient`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from outbox.message import Email
from relay.pause import ACCOUNT, Scope

__all__ = [
    "Accepted",
    "Ambiguous",
    "BaseSender",
    "Disabled",
    "Outcome",
    "OutgoingMessage",
    "Permanent",
    "Sender",
    "Transient",
    "as_sender",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class OutgoingMessage:
    """What a sender gets: the email and the row it came from (for tags and logs).

    ``claim_token`` names this attempt: the claim under which the relay sends it. A sender that
    can tag its mail (SES's ``outbox_attempt`` tag) sends it along, so a provider event maps
    to the exact attempt it reports on (None: a message built outside a relay's claim)."""

    id: int
    key: str
    category: str
    attempt: int  # 1 for the first attempt
    email: Email
    claim_token: str | None = None


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
    """What the relay sends through. Called from worker threads: must be thread-safe.

    Subclass :class:`BaseSender` and write :meth:`send`: it gives the other members their
    defaults."""

    @property
    def name(self) -> str:
        """A short name for logs and the ``outbox_relay_info`` metric (``ses``, ``smtp``)."""
        ...

    def send(self, message: OutgoingMessage) -> Outcome:
        """Deliver ``message`` and classify what happened. Must not raise for delivery errors."""
        ...

    def close(self) -> None:
        """Release connections. ``outbox-relay run`` calls it once at exit, when no send is in
        flight."""
        ...

    def max_send_rate(self) -> float | None:
        """The account's send rate in recipients per second, read by ``--max-send-rate auto``;
        None if the provider does not say."""
        ...


class BaseSender(abc.ABC):
    """A :class:`Sender` with defaults: the class name as :attr:`name`, a :meth:`close` that
    does nothing and no account rate. Subclasses write :meth:`send` and override the rest as
    needed (``name = "mine"`` as a class attribute)."""

    __slots__ = ()

    # False for a development sender that only records each message (console, file): the
    # relay then warns at start that nothing is delivered
    delivers: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return type(self).__name__

    @abc.abstractmethod
    def send(self, message: OutgoingMessage) -> Outcome:
        """Deliver ``message`` and classify what happened. Must not raise for delivery errors."""

    def close(self) -> None:  # noqa: B027 (doing nothing is the default)
        """Nothing to release."""

    def max_send_rate(self) -> float | None:
        """No account rate known."""
        return None

    def where(self) -> dict[str, str]:
        """Where this sender sends (region, endpoint), for the relay's start line: nothing
        to say by default."""
        return {}


def as_sender(candidate: object) -> Sender:
    """``candidate`` as a full :class:`Sender`: itself if it has every member, else wrapped so
    the members it lacks get :class:`BaseSender`'s defaults (an object with only ``send`` is a
    sender; its ``name`` is its class name). Raises :class:`TypeError` if it has no callable
    ``send``."""
    send = getattr(candidate, "send", None)
    if not callable(send):
        raise TypeError(f"an instance of {type(candidate).__name__}, which has no send(message)")
    try:  # reading a member may run a property, which may raise
        if isinstance(candidate, Sender) and _complete(candidate):
            return candidate
        return _Adapted(candidate, send)
    except Exception as exc:
        raise TypeError(
            f"an instance of {type(candidate).__name__}, whose members cannot be read: {exc!r}"
        ) from exc


def _complete(sender: Sender) -> bool:
    """Whether the members are usable too, not only present (``close = None`` is not)."""
    return (
        isinstance(sender.name, str) and callable(sender.close) and callable(sender.max_send_rate)
    )


class _Adapted(BaseSender):
    """A sender written without :class:`BaseSender`: its own members where it has them."""

    __slots__ = ("_close", "_name", "_rate", "_send", "wrapped")

    def __init__(self, wrapped: object, send: Callable[[OutgoingMessage], Outcome]) -> None:
        self.wrapped = wrapped
        self._send = send
        name = getattr(wrapped, "name", None)
        self._name = name if isinstance(name, str) else type(wrapped).__name__
        close = getattr(wrapped, "close", None)
        self._close: Callable[[], object] | None = close if callable(close) else None
        rate = getattr(wrapped, "max_send_rate", None)
        self._rate: Callable[[], float | None] | None = rate if callable(rate) else None

    @property
    def name(self) -> str:
        return self._name

    def send(self, message: OutgoingMessage) -> Outcome:
        return self._send(message)

    def close(self) -> None:
        if self._close is not None:
            self._close()

    def max_send_rate(self) -> float | None:
        rate = None if self._rate is None else self._rate()
        # not a number: no rate (the relay then warns and uses its fallback)
        return float(rate) if isinstance(rate, int | float) and not isinstance(rate, bool) else None

    def __repr__(self) -> str:
        return f"as_sender({self.wrapped!r})"
