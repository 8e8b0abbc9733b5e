"""The relay's settings, checked before it starts: a bad value names its flag and stops it."""

from __future__ import annotations

import fnmatch
import math
import os
import re
import socket
import uuid
from dataclasses import dataclass, field
from typing import Literal, TypeGuard
from urllib.parse import urlsplit

import sqlalchemy as sa
from sqlalchemy.exc import ArgumentError

from outbox.exceptions import ConfigurationError
from relay.limits import ScopeLimit, parse_limit

__all__ = [
    "EVENTS_WAIT_RANGE",
    "MAX_SEND_RATE_RANGE",
    "URL_FORMS",
    "IntakeConfig",
    "RelayConfig",
    "default_relay_id",
    "valid_send_rate",
]

MAX_SEND_RATE_RANGE = (0.001, 1_000_000.0)  # recipients per second: one per 17 min to a million
EVENTS_WAIT_RANGE = (0, 20)  # seconds of an SQS long poll: SQS allows no more


def valid_send_rate(value: object) -> TypeGuard[float]:
    """Whether ``value`` is a send rate the relay can keep (a number within
    :data:`MAX_SEND_RATE_RANGE`): a given ``--max-send-rate``, or a sender's account rate."""
    low, high = MAX_SEND_RATE_RANGE
    return not isinstance(value, bool) and isinstance(value, int | float) and low <= value <= high


def default_relay_id() -> str:
    """``host-pid-xxxx``: unique per process, readable in ``outbox_relays`` and logs."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


URL_FORMS = "postgresql+psycopg://, mysql+pymysql:// or sqlite:///PATH"


@dataclass(frozen=True, kw_only=True, slots=True)
class RelayConfig:
    """Settings of one relay process; see ``outbox-relay run --help`` for each."""

    database_url: str
    sender: str | None = None  # the CLI's --sender; no default (console delivers nothing)
    concurrency: int = 8
    batch_size: int = 50
    lease_seconds: float = 120.0
    send_timeout: float = 20.0
    poll_interval: float = 1.0
    max_send_rate: float | Literal["auto"] | None = None
    drain_seconds: float = 45.0
    pause_seconds: float = 60.0
    exit_when_idle: bool = False
    relay_id: str = field(default_factory=default_relay_id)
    # --key-limit and --identity-limit, as given (PATTERN=SPEC) or parsed (relay.limits)
    key_limits: tuple[str | ScopeLimit, ...] = ()
    identity_limits: tuple[str | ScopeLimit, ...] = ()

    def __post_init__(self) -> None:
        try:
            url = sa.make_url(self.database_url)
        except (ArgumentError, ValueError) as exc:  # the URL is not echoed: it may hold a password
            raise ConfigurationError(
                "--database-url",
                f"not a database URL ({exc}): expected "
                f"dialect+driver://user:password@host:port/database, such as {URL_FORMS}",
            ) from None
        if url.get_backend_name() not in ("postgresql", "mysql", "mariadb", "sqlite"):
            raise ConfigurationError(
                "--database-url", f"unknown database {url.get_backend_name()!r}: use {URL_FORMS}"
            )
        _int("--concurrency", self.concurrency, 1, 1000)
        _int("--batch-size", self.batch_size, 1, 10_000)
        _positive("--lease-seconds", self.lease_seconds)
        _positive("--send-timeout", self.send_timeout)
        _positive("--poll-interval", self.poll_interval)
        _positive("--pause-seconds", self.pause_seconds)
        if self.max_send_rate not in (None, "auto") and not valid_send_rate(self.max_send_rate):
            low, high = MAX_SEND_RATE_RANGE
            raise ConfigurationError(
                "--max-send-rate", f"must be 'auto' or a number from {low:g} to {high:g}"
            )
        if not (isinstance(self.drain_seconds, int | float) and self.drain_seconds >= 0):
            raise ConfigurationError("--drain-seconds", "must be zero or a positive number")
        if self.lease_seconds <= 2 * self.send_timeout:
            raise ConfigurationError(
                "--lease-seconds",
                f"must be more than twice --send-timeout ({self.send_timeout:g}s), so a lease "
                "never runs out while a send may still be in flight",
            )
        if self.drain_seconds < self.send_timeout:
            raise ConfigurationError(
                "--drain-seconds",
                f"must be at least --send-timeout ({self.send_timeout:g}s), so a deploy lets "
                "every send in flight finish",
            )
        if not self.relay_id or len(self.relay_id) > 255:
            raise ConfigurationError("--relay-id", "must be 1 to 255 characters")
        for name, kind in (("key_limits", "key"), ("identity_limits", "identity")):
            flag = f"--{kind}-limit"
            given = getattr(self, name)
            if isinstance(given, str):  # one limit, not a tuple of its characters
                given = (given,)
            parsed = tuple(
                item if isinstance(item, ScopeLimit) else parse_limit(_text(item, flag), kind, flag)
                for item in given
            )
            _check_order(parsed, flag)
            object.__setattr__(self, name, parsed)

    @property
    def limits(self) -> tuple[ScopeLimit, ...]:
        """Every --key-limit and --identity-limit, parsed."""
        return tuple(
            item
            for item in (*self.key_limits, *self.identity_limits)
            if isinstance(item, ScopeLimit)
        )

    @property
    def heartbeat_interval(self) -> float:
        return min(10.0, self.lease_seconds / 4)


def _check_order(limits: tuple[ScopeLimit, ...], flag: str) -> None:
    """The first matching limit wins, so a limit an earlier one surely covers would never
    apply: refused, rather than silently dropped. Surely: the same pattern, an earlier ``*``,
    a later pattern with no wildcard that the earlier matches; for identities, an earlier
    domain pattern that matches a later pattern's domain (the domain is tried for every
    address of it)."""
    for i, later in enumerate(limits):
        for earlier in limits[:i]:
            if _covers(earlier.pattern, later.pattern, later.kind):
                raise ConfigurationError(
                    flag,
                    f"'{later}' never applies: '{earlier}' comes first and matches every "
                    f"{later.kind} it matches (the first match wins; give one {flag} per "
                    "pattern, both limits comma-separated, narrower patterns first)",
                )


def _covers(earlier: str, later: str, kind: str) -> bool:
    if earlier in (later, "*") or (not _WILD.search(later) and fnmatch.fnmatchcase(later, earlier)):
        return True
    if kind != "identity" or "@" in earlier:
        return False
    domain = later.rpartition("@")[2]  # a domain, or an address pattern's; or above it
    if _WILD.search(domain):
        return False
    labels = domain.split(".")
    return any(fnmatch.fnmatchcase(".".join(labels[i:]), earlier) for i in range(len(labels)))


_WILD = re.compile(r"[*?\[]")


def _text(value: object, flag: str) -> str:
    if not isinstance(value, str):
        raise ConfigurationError(flag, f"{value!r} is not PATTERN=SPEC text")
    return value


def _int(setting: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigurationError(setting, f"must be an integer from {low} to {high}")


def _positive(setting: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigurationError(setting, "must be a positive number")


@dataclass(frozen=True, kw_only=True, slots=True)
class IntakeConfig:
    """Settings of the event intake (``--events-queue-url`` and its wait); see
    ``outbox-relay events --help``."""

    queue_url: str
    wait_seconds: int = 20
    wait_option: str = "--wait-seconds"  # the flag that set wait_seconds, for its error

    def __post_init__(self) -> None:
        parts = urlsplit(self.queue_url) if isinstance(self.queue_url, str) else None
        if (
            parts is None
            or parts.scheme not in ("https", "http")
            or not parts.hostname
            or parts.path.strip("/") == ""
        ):
            raise ConfigurationError(
                "--events-queue-url",
                f"{self.queue_url!r} is not an SQS queue URL: expected "
                "https://sqs.<region>.amazonaws.com/<account>/<queue>",
            )
        low, high = EVENTS_WAIT_RANGE
        _int(self.wait_option, self.wait_seconds, low, high)
