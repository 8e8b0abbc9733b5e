"""How a check comes out: :class:`Level`, :class:`Check` (one line of ``doctor``) and the
report they make (:func:`render`)."""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Check", "Level", "first_line", "render", "worst"]


class Level(enum.Enum):
    """How a check came out."""

    OK = "ok"  # nothing to do
    WARN = "warn"  # mail flows, but something is worth a look, or could not be checked
    FAIL = "fail"  # mail will not flow (or not as configured) until this is fixed


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """One line of ``doctor``: what was checked, how it came out, what was found, the fix."""

    check: str
    status: Level
    found: str
    fix: str | None = None

    def line(self) -> str:
        fix = f"; {self.fix}" if self.fix else ""
        return f"{self.status.value:<4}  {self.check}: {self.found}{fix}"

    def as_dict(self) -> dict[str, str | None]:
        return {
            "check": self.check,
            "status": self.status.value,
            "found": self.found,
            "fix": self.fix,
        }


def render(checks: Sequence[Check], *, as_json: bool) -> str:
    """The report: one line a check, or a JSON list of ``{check, status, found, fix}``."""
    if as_json:
        return json.dumps([c.as_dict() for c in checks], indent=2)
    return "\n".join(c.line() for c in checks)


def worst(levels: Iterable[Level]) -> Level:
    found = set(levels)
    return Level.FAIL if Level.FAIL in found else Level.WARN if Level.WARN in found else Level.OK


def first_line(error: BaseException) -> str:
    orig = getattr(error, "orig", None) or error
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0].strip()
