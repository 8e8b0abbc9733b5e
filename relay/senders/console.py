"""A sender that prints one line per message instead of delivering it: for local work only.

Nothing is delivered and every message is marked sent, so ``outbox-relay run`` uses it only
when asked by name (``--sender console``) and says so at start. The line never shows a body
or a subject (a password-reset code), and recipients are masked (``a***@example.com``).
"""

from __future__ import annotations

import sys
import threading
from email.utils import parseaddr
from typing import TextIO

from relay.senders import Accepted, BaseSender, Outcome, OutgoingMessage

__all__ = ["ConsoleSender", "masked"]


def masked(address: str) -> str:
    """``address`` with its local part hidden but its first character: ``a***@example.com``."""
    local, _, domain = parseaddr(address)[1].rpartition("@")
    return f"{local[:1]}***@{domain}"


class ConsoleSender(BaseSender):
    """Writes a short, masked summary of each message to ``stream``."""

    name = "console"

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()

    def send(self, message: OutgoingMessage) -> Outcome:
        recipients = message.email.recipients
        line = (
            f"[outbox] message {message.id} ({message.category}) to {len(recipients)} "
            f"recipient(s) {', '.join(masked(a) for a in recipients)}: not delivered "
            "(console sender)\n"
        )
        with self._lock:
            self._stream.write(line)
            self._stream.flush()
        return Accepted(provider_message_id=f"console-{message.id}")
