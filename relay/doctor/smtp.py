"""The SMTP server's check: one session opened and closed (:func:`check_smtp`)."""

from __future__ import annotations

from collections.abc import Callable

from outbox.exceptions import ConfigurationError
from relay.doctor.report import Check, Level, first_line

__all__ = ["check_smtp"]


def check_smtp(probe: Callable[[], str], where: str) -> Check:
    """One session opened as a send opens it, then closed; nothing is sent."""
    name = "smtp server"
    try:
        done = probe()
    except ConfigurationError as exc:
        return Check(check=name, status=Level.FAIL, found=str(exc), fix="fix the --smtp-* flags")
    except Exception as exc:
        return Check(
            check=name,
            status=Level.FAIL,
            found=f"{where}: {type(exc).__name__}: {first_line(exc)}",
            fix="check --smtp-host, --smtp-port, --smtp-security and the login",
        )
    return Check(check=name, status=Level.OK, found=f"{where}: {done}")
