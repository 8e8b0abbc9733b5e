"""Limits per fairness key and per sending identity (``--key-limit``, ``--identity-limit``):
what each flag says, and which limited scopes a message belongs to.

A limit is ``PATTERN=SPEC``: ``SPEC`` is ``RATE/s`` (recipients per second), ``inflight:N``
(sends at once), or both, comma-separated (``tenant-*=5/s,inflight:10``). Each key (or
identity) the pattern matches has a budget of its own, held across every relay through the
database: ``tenant-*=5/s`` gives ``tenant-1`` and ``tenant-2`` 5/s each. The first limit whose
pattern matches wins. An identity limit's pattern is matched against the From address and
then each of its domains (``a@mail.example.com``, ``mail.example.com``, ``example.com``), so
``example.com=10/s`` holds all of that domain's mail to 10/s together and ``*@example.com=2/s``
each of its addresses to 2/s.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from outbox.exceptions import ConfigurationError
from relay.pause import identities

__all__ = ["Limits", "ScopeLimit", "parse_limit"]

_RATE = re.compile(r"(?P<rate>[0-9]*\.?[0-9]+)/s")
_IN_FLIGHT = re.compile(r"inflight:(?P<count>[0-9]+)")
_RATE_RANGE = (0.001, 1_000_000.0)
_IN_FLIGHT_RANGE = (1, 100_000)


@dataclass(frozen=True, kw_only=True, slots=True)
class ScopeLimit:
    """One ``--key-limit`` or ``--identity-limit``: the keys or identities ``pattern`` matches
    each get ``rate`` recipients per second and ``in_flight`` sends at once (None: no such
    limit)."""

    kind: str  # "key" or "identity"
    pattern: str
    rate: float | None = None
    in_flight: int | None = None

    def __str__(self) -> str:
        parts = [f"{self.rate:g}/s"] if self.rate is not None else []
        if self.in_flight is not None:
            parts.append(f"inflight:{self.in_flight}")
        return f"{self.pattern}={','.join(parts)}"


def parse_limit(text: str, kind: str, flag: str) -> ScopeLimit:
    """A :class:`ScopeLimit` from ``PATTERN=SPEC``; ConfigurationError naming ``flag`` else."""
    pattern, sep, spec = text.rpartition("=")
    form = "expected PATTERN=RATE/s, PATTERN=inflight:N or PATTERN=RATE/s,inflight:N"
    if not sep or not pattern.strip() or not spec:
        raise ConfigurationError(flag, f"{text!r}: {form}")
    if "=" in pattern:  # 'x=5/s=3/s' would be the pattern 'x=5/s'
        raise ConfigurationError(flag, f"{text!r}: one '=' only; {form}")
    rate: float | None = None
    in_flight: int | None = None
    for item in spec.split(","):
        item = item.strip()
        if (match := _RATE.fullmatch(item)) and rate is None:
            rate = float(match["rate"])
            low, high = _RATE_RANGE
            if not (math.isfinite(rate) and low <= rate <= high):
                raise ConfigurationError(
                    flag, f"{text!r}: the rate must be from {low:g} to {high:g} per second"
                )
        elif (match := _IN_FLIGHT.fullmatch(item)) and in_flight is None:
            in_flight = int(match["count"])
            low_n, high_n = _IN_FLIGHT_RANGE
            if not low_n <= in_flight <= high_n:
                raise ConfigurationError(
                    flag, f"{text!r}: inflight must be from {low_n} to {high_n}"
                )
        else:
            raise ConfigurationError(flag, f"{text!r}: {item!r} is not understood; {form}")
    if kind == "identity":
        pattern = pattern.lower()  # identities are compared in lower case
    return ScopeLimit(kind=kind, pattern=pattern, rate=rate, in_flight=in_flight)


class Limits:
    """The per-key and per-identity limits a relay keeps: which limited scopes a message
    belongs to (``key:...``, ``identity:...``), each with its limit."""

    def __init__(self, limits: Iterable[ScopeLimit] = ()) -> None:
        self.keys = [limit for limit in limits if limit.kind == "key"]
        self.identities = [limit for limit in limits if limit.kind == "identity"]

    def __bool__(self) -> bool:
        return bool(self.keys or self.identities)

    def scopes(self, fairness_key: str | None, sender: str) -> tuple[tuple[str, ScopeLimit], ...]:
        """The limited scopes of a message of ``fairness_key`` from ``sender``."""
        found: list[tuple[str, ScopeLimit]] = []
        if fairness_key is not None:
            limit = next(
                (k for k in self.keys if fnmatch.fnmatchcase(fairness_key, k.pattern)), None
            )
            if limit is not None:
                found.append(("key:" + fairness_key, limit))
        if self.identities:
            candidates = identities(sender)
            for limit in self.identities:
                name = next((c for c in candidates if fnmatch.fnmatchcase(c, limit.pattern)), None)
                if name is not None:
                    found.append(("identity:" + name, limit))
                    break
        return tuple(found)
